// Package logging builds the logrus logger every binary uses and holds the helpers through
// which URLs and servers' answers reach logs and errors: RedactURL, RedactText.
package logging

import (
	"bytes"
	"fmt"
	"io"
	"net/url"
	"regexp"
	"strings"

	"github.com/sirupsen/logrus"
)

// New returns a logger writing to out at level ("debug", "info", "warn", "error") in format
// ("json" or "text").
func New(level, format string, out io.Writer) (*logrus.Logger, error) {
	lvl, err := logrus.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	l := logrus.New()
	l.SetOutput(out)
	l.SetLevel(lvl)
	switch strings.ToLower(format) {
	case "json", "":
		l.SetFormatter(warnName{&logrus.JSONFormatter{}, []byte(`"level":"warning"`), []byte(`"level":"warn"`)})
	case "text":
		l.SetFormatter(warnName{&logrus.TextFormatter{FullTimestamp: true, DisableColors: true},
			[]byte(" level=warning "), []byte(" level=warn ")})
	default:
		return nil, fmt.Errorf("log format %q: want json or text", format)
	}
	return l, nil
}

// warnName names the warning level "warn", as SPIEGEL_LOG_LEVEL and the other levels' names
// (debug, info, error) do; logrus calls it "warning". It rewrites the first occurrence of the
// level's key and value in a warning entry's output: the formatters write the level before the
// entry's fields, and rename a field called "level" to "fields.level", so the first is the level.
type warnName struct {
	logrus.Formatter
	logrus, ours []byte
}

// Format implements logrus.Formatter.
func (f warnName) Format(e *logrus.Entry) ([]byte, error) {
	b, err := f.Formatter.Format(e)
	if err != nil || e.Level != logrus.WarnLevel {
		return b, err
	}
	return bytes.Replace(b, f.logrus, f.ours, 1), nil
}

// RedactURL returns raw with any password in its user info replaced by "xxxxx". A string that
// does not parse as a URL is scanned for "scheme://user:pass@" sequences instead, so no input
// leaks a password.
func RedactURL(raw string) string {
	if !strings.Contains(raw, "@") {
		return raw // no user info, so no password: nothing to parse
	}
	u, err := url.Parse(raw)
	if err == nil && u.User != nil {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
			return u.String()
		}
		return raw
	}
	return RedactText(raw)
}

var (
	userinfoRE = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^@/\s]*@`)
	// credentialRE: an Authorization header's credentials or a session cookie, as a server that
	// quotes the request echoes them (CouchDB's 500 answers to a crash dump the request, its
	// Authorization header included). A JSON body may escape the token's slashes.
	credentialRE = regexp.MustCompile(`(Basic |Bearer |AuthSession=)(?:[A-Za-z0-9+/=._~-]|\\/)+`)
)

// RedactText replaces the password of every "scheme://user:password@" in s, and the credentials
// of every "Basic ", "Bearer " and "AuthSession=" in it, with "xxxxx". Use it on error messages
// from libraries that may quote a URL and on answers of servers that may quote a request.
func RedactText(s string) string {
	if strings.Contains(s, "@") {
		s = userinfoRE.ReplaceAllString(s, "${1}:xxxxx@")
	}
	if strings.Contains(s, "Basic ") || strings.Contains(s, "Bearer ") || strings.Contains(s, "AuthSession=") {
		s = credentialRE.ReplaceAllString(s, "${1}xxxxx")
	}
	return s
}
