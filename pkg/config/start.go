package config

import (
	"fmt"
	"net/url"
	"reflect"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// redacted replaces a secret in what is printed or logged.
const redacted = "xxxxx"

// Effective returns the configuration spec holds (after Load), by variable name, as it may be
// logged: secrets (NATS password and token) are "xxxxx" when set, and the credentials of every
// URL are hidden (a password, or a user without password, as NATS takes a token, is "xxxxx").
func Effective(spec any) map[string]string {
	out := map[string]string{}
	v := reflect.ValueOf(spec).Elem()
	for _, vr := range Vars(spec) {
		f, ok := fieldOf(v, vr.Name)
		if !ok || vr.Deprecated != "" {
			continue
		}
		s := valueString(f)
		switch {
		case vr.Secret && s != "":
			s = redacted
		case strings.Contains(s, "@"):
			s = redactURLs(s)
		}
		out[vr.Name] = s
	}
	return out
}

func valueString(f reflect.Value) string {
	if l, ok := f.Interface().([]string); ok {
		return strings.Join(l, ",")
	}
	if m, ok := f.Interface().(MaxConns); ok && m == AutoConns {
		return "auto"
	}
	return fmt.Sprint(f.Interface())
}

// redactURLs hides the credentials of each comma-separated URL of s (logging.RedactURL hides a
// password; a user alone is hidden too, since nats://TOKEN@host carries a token there). What
// does not parse goes through logging.RedactText, and when an "@" is left after a "://", the
// whole item is hidden: an unusual URL must not leak what it holds.
func redactURLs(s string) string {
	items := strings.Split(s, ",")
	for i, it := range items {
		u, err := url.Parse(strings.TrimSpace(it))
		switch {
		case err == nil && u.User != nil:
			if _, has := u.User.Password(); has {
				it = logging.RedactURL(u.String())
			} else {
				u.User = url.User(redacted)
				it = u.String()
			}
		case err != nil:
			it = logging.RedactText(it)
		}
		if _, rest, ok := strings.Cut(it, "://"); ok && strings.Count(rest, "@") > 0 && !strings.Contains(rest, redacted+"@") {
			it = redacted
		}
		items[i] = it
	}
	return strings.Join(items, ",")
}

// LogStart logs what a process starts with, once, at info: the component, the build (version,
// commit, commit time, dirty, Go version) and the effective configuration of spec, redacted
// (Effective); then one warning per unknown or deprecated SPIEGEL_* variable of environ
// (CheckEnv). Nothing secret is logged.
func LogStart(log logrus.FieldLogger, component string, spec any, environ []string) {
	b := ReadBuild()
	log.WithFields(logrus.Fields{
		"component": component, "version": b.Version, "commit": b.Commit, "commit_time": b.CommitTime,
		"dirty": b.Dirty, "go_version": b.GoVersion, "config": Effective(spec),
	}).Info("starting")
	WarnEnv(log, component, spec, environ)
}

// WarnEnv logs one warning per unknown or deprecated SPIEGEL_* variable of environ (CheckEnv).
func WarnEnv(log logrus.FieldLogger, component string, spec any, environ []string) {
	for _, w := range CheckEnv(spec, environ) {
		log.WithField("component", component).Warn(w.String())
	}
}
