package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// replicator is the watched server's _replicate (*couch.Client).
type replicatorAPI interface {
	Replicate(ctx context.Context, body []byte) ([]byte, error)
}

// couchEngine replicates with the watched server's own replicator: one synchronous, one-shot
// POST /_replicate per call. CouchDB (and PouchDB Server) keeps the checkpoints, so running the
// same replication again only costs a comparison of checkpoints when nothing changed.
type couchEngine struct {
	server replicatorAPI
}

// Replicate sends body to POST /_replicate and waits for the answer; ctx bounds the request
// (the caller sets the per-replication timeout). body holds credentials: it is never logged,
// and no error returned holds a password (errors go through scrub). A refusal of the server is a
// *replicateError.
func (e couchEngine) Replicate(ctx context.Context, body map[string]any, secrets []string) (result, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return result{}, fmt.Errorf("encode replication request: %w", err)
	}
	answer, err := e.server.Replicate(ctx, data)
	var he *couch.HTTPError
	switch {
	case errors.As(err, &he):
		return result{}, newReplicateError(he, secrets)
	case err != nil:
		return result{}, &scrubbedError{msg: scrub(err.Error(), secrets), err: err}
	}
	res, err := parseResult(answer)
	if err != nil {
		return result{}, errors.New(scrub(err.Error(), secrets))
	}
	return res, nil
}

// scrubbedError is a failure whose message is scrubbed of secrets; it keeps the original for
// errors.Is (context.DeadlineExceeded).
type scrubbedError struct {
	msg string
	err error
}

func (e *scrubbedError) Error() string { return e.msg }
func (e *scrubbedError) Unwrap() error { return e.err }

// replicateError is a refusal of a replication: its status and CouchDB's error and reason,
// scrubbed of passwords.
type replicateError struct {
	Op        string // what was refused: "" means POST /_replicate
	Status    int
	ErrorName string
	Reason    string
}

func newReplicateError(he *couch.HTTPError, secrets []string) *replicateError {
	return &replicateError{Status: he.Status, ErrorName: scrub(he.ErrorName, secrets), Reason: scrub(he.Reason, secrets)}
}

func (e *replicateError) Error() string {
	var b strings.Builder
	op := e.Op
	if op == "" {
		op = "POST /_replicate"
	}
	fmt.Fprintf(&b, "%s: %d", op, e.Status)
	if e.ErrorName != "" {
		b.WriteString(" " + e.ErrorName)
	} else if t := http.StatusText(e.Status); t != "" {
		b.WriteString(" " + t)
	}
	if e.Reason != "" {
		b.WriteString(": " + e.Reason)
	}
	return b.String()
}

// class is the replication failure's class (couch.Classify).
func (e *replicateError) class() couch.Class {
	return couch.Classify(&couch.HTTPError{Status: e.Status, ErrorName: e.ErrorName, Reason: e.Reason})
}

// failure kinds of one replication.
type failureKind int

const (
	// transient: network, 5xx, timeout; the job is retried with backoff.
	transient failureKind = iota
	// permanent: credentials refused, a request the server rejects; retrying cannot help.
	permanent
	// dbNotFound: CouchDB's db_not_found, which its replicator also answers when an endpoint
	// answers any unexpected status (a 503 of a proxy): retried for a while, then permanent.
	dbNotFound
)

// classify tells what a failed replication means for its retry, from couch.Classify:
//
//   - Auth (401/403, or CouchDB's unauthorized, forbidden, replication_auth_error — a 500 on
//     3.x) and Permanent (a bad parameter, a bad URL, 405, 409, 412, 413, 415): permanent.
//   - db_not_found (CouchDB answers 500 for a missing source or target, or an endpoint that
//     answered an unexpected status): dbNotFound. Another not-found (a filter that does not
//     exist): permanent.
//   - everything else (5xx, 429, no answer, timeout, and PouchDB Server's 400 "request to ...
//     failed, reason: connect ECONNREFUSED"): transient.
func classify(err error) failureKind {
	var re *replicateError
	if !errors.As(err, &re) {
		return transient
	}
	switch re.class() {
	case couch.Auth, couch.Permanent:
		return permanent
	case couch.NotFound:
		if re.ErrorName == "db_not_found" {
			return dbNotFound
		}
		return permanent
	}
	return transient
}

// authStatus returns 401 or 403 when err says the credentials of a source or target were
// refused, whatever status carried it (CouchDB 3 answers a wrong endpoint password with 500
// replication_auth_error), and 0 otherwise.
func authStatus(err error) int {
	var re *replicateError
	if !errors.As(err, &re) || re.class() != couch.Auth {
		return 0
	}
	if re.ErrorName == "forbidden" || re.Status == http.StatusForbidden {
		return http.StatusForbidden
	}
	return http.StatusUnauthorized
}

// scrub returns s with URL passwords redacted and every secret (of at least 4 bytes, also in
// its URL-escaped forms) replaced by "xxxxx".
func scrub(s string, secrets []string) string {
	s = logging.RedactText(s)
	for _, sec := range secrets {
		if len(sec) < 4 {
			continue
		}
		for _, form := range []string{sec, url.QueryEscape(sec), url.PathEscape(sec), url.UserPassword("u", sec).String()[2:]} {
			if form != "" {
				s = strings.ReplaceAll(s, form, "xxxxx")
			}
		}
	}
	return s
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
