// Package passwords holds the passwords file (SPEC §2.3): the passwords rule URLs must not
// carry, injected into URLs only at request time.
//
// The file is JSON:
//
//	{
//	  "couch.example":      {"user": "password"},
//	  "couch.example:6984": {"user": "other password"},
//	  "_secrets":           {"webhook_hmac": "key"}
//	}
//
// Host keys are hostnames without port, as in the original Spiegel; a "host:port" key, when
// present, wins over the bare hostname for URLs with that explicit port (an IPv6 host is written
// "[::1]:5984"). Host keys are case-insensitive, user names are not. The optional "_secrets"
// object holds named secrets that are not URL passwords, such as an HMAC key for webhook
// signatures (see Secret). No error and no String method of this package ever shows a password.
package passwords

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
)

// SecretsKey is the top-level key of the named-secrets section.
const SecretsKey = "_secrets"

// File is a loaded passwords file. It is safe for concurrent use; Reload swaps the content
// atomically for readers.
type File struct {
	path string

	mu      sync.RWMutex
	hosts   map[string]map[string]string // lower-case host[:port] → user → password
	secrets map[string]string
}

// Load reads the passwords file at path. An empty path gives an empty File (every URL stays as
// it is). Errors name the path and the reason, never a password.
func Load(path string) (*File, error) {
	f := &File{path: path, hosts: map[string]map[string]string{}, secrets: map[string]string{}}
	if path == "" {
		return f, nil
	}
	if err := f.Reload(); err != nil {
		return nil, err
	}
	return f, nil
}

// Reload reads the file again (on SIGHUP). On error the old content stays in use. With an empty
// path it does nothing.
func (f *File) Reload() error {
	if f.path == "" {
		return nil
	}
	data, err := os.ReadFile(f.path)
	if err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return fmt.Errorf("read passwords file %s: %w", f.path, err)
	}
	hosts, secrets, err := parse(data)
	if err != nil {
		return fmt.Errorf("parse passwords file %s: %w", f.path, err)
	}
	f.mu.Lock()
	f.hosts, f.secrets = hosts, secrets
	f.mu.Unlock()
	return nil
}

// parse decodes the file content. Its errors quote keys (hosts, users, secret names) but never
// values.
func parse(data []byte) (map[string]map[string]string, map[string]string, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			return nil, nil, fmt.Errorf("invalid JSON at byte offset %d", syn.Offset)
		}
		return nil, nil, errors.New(`want a JSON object {"host": {"user": "password"}}`)
	}
	hosts := map[string]map[string]string{}
	secrets := map[string]string{}
	for key, raw := range top {
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil || m == nil {
			return nil, nil, fmt.Errorf("%q: want an object of name → string", key)
		}
		vals := map[string]string{}
		for name, v := range m {
			s, ok := v.(string)
			if !ok {
				return nil, nil, fmt.Errorf("%q: %q: the value must be a string", key, name)
			}
			vals[name] = s
		}
		if key == SecretsKey {
			secrets = vals
			continue
		}
		host := strings.ToLower(key)
		if hosts[host] == nil {
			hosts[host] = map[string]string{}
		}
		for user, pw := range vals {
			hosts[host][user] = pw
		}
	}
	return hosts, secrets, nil
}

// ErrBadURL is returned by Inject for a URL that does not parse. Its text never quotes the URL.
var ErrBadURL = errors.New("inject password: the URL does not parse")

// Inject returns rawURL with the password of its user added. A URL without a user, with a
// password already, without a "scheme://" or without an entry in the file is returned unchanged.
// The password comes from the "host:port" key when the URL has an explicit port and that key
// exists, else from the hostname key. The only error is ErrBadURL.
func (f *File) Inject(rawURL string) (string, error) {
	if !strings.Contains(rawURL, "://") {
		return rawURL, nil
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", ErrBadURL
	}
	if u.User == nil {
		return rawURL, nil
	}
	if _, has := u.User.Password(); has {
		return rawURL, nil
	}
	pw, ok := f.Lookup(u.Hostname(), u.Port(), u.User.Username())
	if !ok {
		return rawURL, nil
	}
	u.User = url.UserPassword(u.User.Username(), pw)
	return u.String(), nil
}

// Lookup returns the password of user at host (a hostname, without brackets for IPv6) and port
// ("" for none): the "host:port" entry first, then the "host" entry.
func (f *File) Lookup(host, port, user string) (string, bool) {
	host = strings.ToLower(host)
	f.mu.RLock()
	defer f.mu.RUnlock()
	if port != "" {
		if pw, ok := f.hosts[strings.ToLower(net.JoinHostPort(host, port))][user]; ok {
			return pw, true
		}
	}
	pw, ok := f.hosts[host][user]
	return pw, ok
}

// Secret returns the named secret of the "_secrets" section.
func (f *File) Secret(name string) (string, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	s, ok := f.secrets[name]
	return s, ok
}

// Secrets returns every non-empty password and secret value, sorted and without duplicates, so
// that tests can check no log line or document holds one.
func (f *File) Secrets() []string {
	f.mu.RLock()
	set := map[string]bool{}
	for _, users := range f.hosts {
		for _, pw := range users {
			set[pw] = true
		}
	}
	for _, s := range f.secrets {
		set[s] = true
	}
	f.mu.RUnlock()
	delete(set, "")
	out := make([]string, 0, len(set))
	for s := range set {
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

// String describes the file without any secret: its path and the number of hosts.
func (f *File) String() string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return fmt.Sprintf("passwords file %q (%d hosts, %d secrets)", f.path, len(f.hosts), len(f.secrets))
}
