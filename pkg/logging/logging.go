// Package logging builds the logrus logger every binary uses and holds the one helper through
// which URLs reach logs and errors: RedactURL.
package logging

import (
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
		l.SetFormatter(&logrus.JSONFormatter{})
	case "text":
		l.SetFormatter(&logrus.TextFormatter{FullTimestamp: true, DisableColors: true})
	default:
		return nil, fmt.Errorf("log format %q: want json or text", format)
	}
	return l, nil
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

var userinfoRE = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^@/\s]*@`)

// RedactText replaces the password of every "scheme://user:password@" in s with "xxxxx". Use it on
// error messages from libraries that may quote a URL.
func RedactText(s string) string {
	if !strings.Contains(s, "@") {
		return s
	}
	return userinfoRE.ReplaceAllString(s, "${1}:xxxxx@")
}
