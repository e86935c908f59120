package e2e

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"testing"
)

// secret is one credential the run uses. User, when set, is the user it belongs to, so that
// the Basic auth form base64("user:secret") is looked for as well.
type secret struct {
	Name, User, Value string
}

// output is one piece of text the run showed to someone: a process's stdout and stderr, a
// command's output, an HTTP body, a NATS message.
type output struct {
	Name, Text string
}

// newSecret returns prefix followed by 16 random hex digits and then special, so that every
// secret is distinctive; special characters make the escaped forms differ from the raw one.
func newSecret(t testing.TB, prefix, special string) string {
	t.Helper()
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		t.Fatalf("random: %v", err)
	}
	return prefix + hex.EncodeToString(b) + special
}

// form is one way a secret can be written.
type form struct {
	kind, text string
}

// forms returns every way s may show up in text: raw, URL-escaped (query, path, user info),
// JSON-escaped (logrus escapes & < > as \u0026...), Go-quoted (logrus text format), hex, the Basic auth header value of
// user:secret, and the base64 core of the secret at each of the three byte alignments (any
// base64 text of a string containing the secret contains one of those cores).
func forms(s secret) []form {
	v := s.Value
	js, _ := json.Marshal(v)
	quoted := strconv.Quote(v)
	fs := []form{
		{"raw", v},
		{"query-escaped", url.QueryEscape(v)},
		{"path-escaped", url.PathEscape(v)},
		{"userinfo-escaped", strings.TrimPrefix(url.UserPassword("u", v).String(), "u:")},
		{"json-escaped", string(js[1 : len(js)-1])},
		{"go-quoted", quoted[1 : len(quoted)-1]}, // logrus text format
		{"hex", hex.EncodeToString([]byte(v))},
	}
	if s.User != "" {
		fs = append(fs, form{"basic-auth", base64.StdEncoding.EncodeToString([]byte(s.User + ":" + v))})
	}
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding} {
		for pad := range 3 {
			if core := base64Core(enc, v, pad); len(core) >= 12 {
				fs = append(fs, form{fmt.Sprintf("base64-core/%d", pad), core})
			}
		}
	}
	seen := map[string]bool{}
	out := fs[:0]
	for _, f := range fs {
		if f.text != "" && !seen[f.kind+"\x00"+f.text] {
			seen[f.kind+"\x00"+f.text] = true
			out = append(out, f)
		}
	}
	return out
}

// base64Core returns the part of the base64 text of (pad bytes + v) that depends on bytes of v
// only: the complete 3-byte groups that lie inside v.
func base64Core(enc *base64.Encoding, v string, pad int) string {
	full := enc.EncodeToString([]byte(strings.Repeat("\x00", pad) + v))
	first := (pad + 2) / 3     // first group starting at or after v's first byte
	last := (pad+len(v))/3 - 1 // last group ending at or before v's last byte
	if last < first {
		return ""
	}
	return full[4*first : 4*(last+1)]
}

// leak is one secret found in one output.
type leak struct {
	output, secret, kind, context string
}

// findLeaks returns every (output, secret, form) where the form occurs in the output.
func findLeaks(outs []output, secrets []secret) []leak {
	var found []leak
	for _, o := range outs {
		for _, s := range secrets {
			for _, f := range forms(s) {
				i := strings.Index(o.Text, f.text)
				if i < 0 {
					continue
				}
				from, to := max(0, i-160), min(len(o.Text), i+len(f.text)+160)
				found = append(found, leak{output: o.Name, secret: s.Name, kind: f.kind, context: o.Text[from:to]})
			}
		}
	}
	return found
}

// The detector itself must find every form it claims to, or the end-to-end test could not fail.
func TestFindLeaksSeesEveryForm(t *testing.T) {
	t.Parallel()
	s := secret{Name: "hook", User: "hook", Value: newSecret(t, "pw-", " +/:@?&=%<>")}
	u := url.URL{Scheme: "http", User: url.UserPassword("hook", s.Value), Host: "h", Path: "/x"}
	js, _ := json.Marshal(map[string]string{"v": s.Value})
	texts := map[string]string{
		"url":        "GET " + u.String(),
		"json":       string(js),
		"basic":      "Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte("hook:"+s.Value)),
		"embedded-1": base64.StdEncoding.EncodeToString([]byte("x" + s.Value + "tail")),
		"embedded-2": base64.URLEncoding.EncodeToString([]byte("xy" + s.Value + "tail")),
		"query":      "?p=" + url.QueryEscape(s.Value),
		"logfmt":     "msg=" + strconv.Quote("bad "+s.Value),
	}
	for name, text := range texts {
		if len(findLeaks([]output{{Name: name, Text: text}}, []secret{s})) == 0 {
			t.Errorf("%s: the secret in %q was not found", name, text)
		}
	}
	if l := findLeaks([]output{{Name: "clean", Text: "GET http://hook:xxxxx@h/x " + strings.Repeat("A", 200)}}, []secret{s}); len(l) != 0 {
		t.Errorf("false positive: %+v", l)
	}
}
