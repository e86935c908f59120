package logging

import (
	"bytes"
	"strings"
	"testing"
	"unicode"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRedactURL(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"http://admin:s3cret@couch:5984/db":  "http://admin:xxxxx@couch:5984/db",
		"http://admin@couch:5984/db":         "http://admin@couch:5984/db",
		"http://couch:5984/db":               "http://couch:5984/db",
		"not a url http://u:p%zz@h/ x":       "not a url http://u:xxxxx@h/ x",
		"Get \"https://a:b@h:1/x\": refused": "Get \"https://a:xxxxx@h:1/x\": refused",
	}
	for in, want := range cases {
		got := RedactURL(in)
		assert.Equal(t, want, got, in)
		assert.NotContains(t, got, "s3cret")
	}
}

func TestNewRejectsBadValues(t *testing.T) {
	t.Parallel()
	_, err := New("loud", "json", &bytes.Buffer{})
	assert.ErrorContains(t, err, "loud")
	_, err = New("info", "xml", &bytes.Buffer{})
	assert.ErrorContains(t, err, "xml")
	var buf bytes.Buffer
	l, err := New("info", "json", &buf)
	require.NoError(t, err)
	l.WithField("component", "x").Info("hello")
	assert.Contains(t, buf.String(), `"component":"x"`)
}

// FuzzRedactURL: whatever surrounds it, a password in a URL's user info never comes out.
func FuzzRedactURL(f *testing.F) {
	f.Add("http", "admin", "s3cretpw", "couch:5984/db", "")
	f.Add("https", "u", "p%zzword", "h:1/x", "Get \"")
	f.Add("http", "", "onlypass", "h", "not a url ")
	f.Fuzz(func(t *testing.T, scheme, user, password, rest, prefix string) {
		if len(password) < 6 || !userInfo(password) || !userInfo(user) || !isScheme(scheme) ||
			strings.Contains(prefix+scheme+user+rest, password) {
			t.Skip() // not a password in user info as a URL writes it, or one that appears elsewhere too
		}
		in := prefix + scheme + "://" + user + ":" + password + "@" + rest
		assert.NotContains(t, RedactURL(in), password, in)
	})
}

// userInfo reports whether s can stand as the user or password of a URL: printable, no space,
// none of the characters that end it.
func userInfo(s string) bool {
	for _, r := range s {
		if r <= ' ' || r == 0x7f || !unicode.IsPrint(r) || strings.ContainsRune("@/:\\\"#?", r) {
			return false
		}
	}
	return true
}

func isScheme(s string) bool {
	for i, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || i > 0 && (r >= '0' && r <= '9' || r == '+' || r == '-' || r == '.')) {
			return false
		}
	}
	return s != ""
}

// A server that quotes the request in an error (CouchDB 3.3.3's 500 after a crash dumps the
// request record) quotes its credentials: they never come out.
func TestRedactTextCredentials(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		`{'Authorization',"Basic c3BpZWdlbDpYcTctcHctOTRrZA=="},nil`: `{'Authorization',"Basic xxxxx"},nil`,
		`authorization: Bearer eyJhbGciOi.eyJzdWIi.c2lnbg-_`:         `authorization: Bearer xxxxx`,
		`{"cookie","AuthSession=c3BpZWdlbDo2OTI0OkFCQ0Q; Path=/"}`:   `{"cookie","AuthSession=xxxxx; Path=/"}`,
		`Basic authentication failed for http://u:pw@h/db`:           `Basic xxxxx failed for http://u:xxxxx@h/db`,
		`"Basic YWRt\/aW46cHc\/+x=\"}`:                               `"Basic xxxxx\"}`,
		`BasicAuth and Bearers stay`:                                 `BasicAuth and Bearers stay`,
	}
	for in, want := range cases {
		assert.Equal(t, want, RedactText(in), in)
	}
}

// FuzzRedactTextCredentials: whatever surrounds it, the credentials of an Authorization header
// or a session cookie never come out.
func FuzzRedactTextCredentials(f *testing.F) {
	f.Add("{'Authorization',\"", "Basic ", "c3BpZWdlbDpYcTctcHctOTRrZA==", "\"}")
	f.Add("", "Bearer ", "eyJhbGciOi.eyJzdWIi", " x")
	f.Add("cookie: ", "AuthSession=", "c3BpZWdlbDo2OTI0", "; Path=/")
	f.Fuzz(func(t *testing.T, prefix, scheme, token, suffix string) {
		if scheme != "Basic " && scheme != "Bearer " && scheme != "AuthSession=" || len(token) < 8 ||
			strings.Trim(token, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=._~-") != "" ||
			strings.Contains(prefix+scheme+suffix, token) || suffix != "" && strings.Contains("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=._~-", suffix[:1]) {
			t.Skip() // not a token as a header writes it, or one that appears elsewhere too
		}
		in := prefix + scheme + token + suffix
		assert.NotContains(t, RedactText(in), token, in)
	})
}

// The warning level is named "warn", as SPIEGEL_LOG_LEVEL calls it, in both formats; the other
// levels keep their names, and a field called "level" does not change the entry's level.
func TestLevelNames(t *testing.T) {
	t.Parallel()
	cases := []struct {
		format string
		log    func(l *logrus.Logger)
		want   string
		not    string
	}{
		{"json", func(l *logrus.Logger) { l.Warn("w") }, `"level":"warn"`, "warning"},
		{"text", func(l *logrus.Logger) { l.Warn("w") }, " level=warn ", "warning"},
		{"json", func(l *logrus.Logger) { l.Error("e") }, `"level":"error"`, "warn"},
		{"text", func(l *logrus.Logger) { l.Info("i") }, " level=info ", "warn"},
		{"json", func(l *logrus.Logger) { l.WithField("level", "warning").Warn("w") }, `"fields.level":"warning"`, `"level":"warning"`},
		{"text", func(l *logrus.Logger) { l.WithField("level", "x").Warn("w") }, "level=warn msg=w fields.level=x", "level=warning"},
	}
	for _, c := range cases {
		var buf bytes.Buffer
		l, err := New("debug", c.format, &buf)
		require.NoError(t, err)
		c.log(l)
		assert.Contains(t, buf.String(), c.want, c.format)
		assert.NotContains(t, buf.String(), c.not, c.format)
	}
}
