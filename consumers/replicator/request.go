package main

import (
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// injector adds passwords to URLs (*passwords.File).
type injector interface {
	Inject(rawURL string) (string, error)
}

// request is one rule's POST /_replicate for one db.
type request struct {
	// Body is the JSON body: the rule's pass-through fields, then source and target with
	// credentials. It holds passwords: never log it.
	Body map[string]any
	// Secrets are the passwords inside Body, to scrub from any text the server sends back.
	Secrets []string
	// Source and Target are the endpoints fit for logs and dead letters (passwords redacted).
	Source, Target string
}

// errInvalidEndpoint marks a source or target that cannot be turned into a URL: the rule is
// broken for this db, so its failure is permanent.
var errInvalidEndpoint = errors.New("invalid replication endpoint")

// buildRequest resolves rule for db into the body of a one-shot POST /_replicate.
//
//   - source and target: $db_name / ${db_name} replaced (rules.Replicator.Resolve). A URL gets
//     the password of its user from pw (SPEC §2.3). A bare db name means a db on the watched
//     server and becomes base (the server's URL, with the service's credentials) plus the
//     escaped name, because CouchDB 3 refuses local endpoints ("local endpoints not supported").
//   - every pass-through field of the rule (rule.Params) is copied as it is; "continuous" and
//     "cancel" are never sent, whatever Params holds, so the replication is always one-shot.
//
// The returned Body is a new map; rule.Params is not modified.
func buildRequest(rule *rules.Replicator, db string, base *url.URL, pw injector) (request, error) {
	src, tgt := rule.Resolve(db)
	var req request
	source, err := endpoint(src, base, pw)
	if err != nil {
		return req, fmt.Errorf("source of rule %s for db %s: %w", rule.ID(), db, err)
	}
	target, err := endpoint(tgt, base, pw)
	if err != nil {
		return req, fmt.Errorf("target of rule %s for db %s: %w", rule.ID(), db, err)
	}
	body := make(map[string]any, len(rule.Params)+2)
	for k, v := range rule.Params {
		body[k] = v
	}
	delete(body, "continuous")
	delete(body, "cancel")
	body["source"], body["target"] = source, target
	req = request{Body: body, Source: logging.RedactURL(source), Target: logging.RedactURL(target)}
	for _, e := range []string{source, target} {
		if u, err := url.Parse(e); err == nil && u.User != nil {
			if p, ok := u.User.Password(); ok && p != "" {
				req.Secrets = append(req.Secrets, p)
			}
		}
	}
	return req, nil
}

// endpoint turns a resolved source or target into the URL sent to _replicate.
func endpoint(s string, base *url.URL, pw injector) (string, error) {
	if strings.Contains(s, "://") {
		withPW, err := pw.Inject(s)
		if err != nil {
			return "", fmt.Errorf("%w: not a valid URL", errInvalidEndpoint)
		}
		return withPW, nil
	}
	if s == "" {
		return "", fmt.Errorf("%w: empty db name", errInvalidEndpoint)
	}
	return strings.TrimRight(base.String(), "/") + "/" + escapeDBName(s), nil
}

// escapeDBName escapes a db name as one URL path segment, strictly: every byte outside RFC
// 3986's unreserved set is percent-encoded, so '/' becomes %2F and '+' %2B (CouchDB would read
// a raw '+' as a space), as rules.Replicator.Resolve does for names inside URLs.
func escapeDBName(name string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(name); i++ {
		c := name[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~' {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}
