package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// maxAnswer bounds the bytes read of one _replicate answer.
const maxAnswer = 4 << 20

// requester builds authenticated requests to the watched server and sends them (*couch.Client).
type requester interface {
	NewRequest(ctx context.Context, method, path string, query url.Values, body io.Reader) (*http.Request, error)
	HTTPClient() *http.Client
}

// couchEngine replicates with the watched server's own replicator: one synchronous, one-shot
// POST /_replicate per call. CouchDB (and PouchDB Server) keeps the checkpoints, so running the
// same replication again only costs a comparison of checkpoints when nothing changed.
type couchEngine struct {
	server requester
}

// Replicate sends body to POST /_replicate and waits for the answer; ctx bounds the request
// (the caller sets the per-replication timeout). body holds credentials: it is never logged,
// and no error returned holds a password (errors go through logging.RedactText and scrub).
// A refusal of the server is a *replicateError.
func (e couchEngine) Replicate(ctx context.Context, body map[string]any, secrets []string) (result, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return result{}, fmt.Errorf("encode replication request: %w", err)
	}
	req, err := e.server.NewRequest(ctx, http.MethodPost, "/_replicate", nil, bytes.NewReader(data))
	if err != nil {
		return result{}, errors.New(scrub(err.Error(), secrets))
	}
	resp, err := e.server.HTTPClient().Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return result{}, &transportError{msg: "POST /_replicate: " + scrub(err.Error(), secrets), err: err}
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	if err != nil {
		return result{}, &transportError{msg: "read answer of POST /_replicate: " + scrub(err.Error(), secrets), err: err}
	}
	if resp.StatusCode >= 300 {
		return result{}, newReplicateError(resp.StatusCode, answer, secrets)
	}
	res, err := parseResult(answer)
	if err != nil {
		return result{}, errors.New(scrub(err.Error(), secrets))
	}
	return res, nil
}

// transportError is a request that got no answer (refused, reset, timed out). It keeps the
// original error for errors.Is (context.DeadlineExceeded) with a scrubbed message.
type transportError struct {
	msg string
	err error
}

func (e *transportError) Error() string { return e.msg }
func (e *transportError) Unwrap() error { return e.err }

// replicateError is a refusal of POST /_replicate: its status and CouchDB's error and reason,
// already scrubbed of passwords.
type replicateError struct {
	Op        string // what was refused: "" means POST /_replicate
	Status    int
	ErrorName string
	Reason    string
}

func newReplicateError(status int, answer []byte, secrets []string) *replicateError {
	e := &replicateError{Status: status}
	var body struct {
		Error  string `json:"error"`
		Reason any    `json:"reason"`
	}
	if json.Unmarshal(answer, &body) == nil {
		e.ErrorName = body.Error
		if s, ok := body.Reason.(string); ok {
			e.Reason = s
		} else if body.Reason != nil {
			b, _ := json.Marshal(body.Reason)
			e.Reason = string(b)
		}
	} else if s := strings.TrimSpace(string(answer)); s != "" {
		e.Reason = truncate(s, 300) // e.g. an HTML error page of a crashed PouchDB Server
	}
	e.ErrorName, e.Reason = scrub(e.ErrorName, secrets), scrub(e.Reason, secrets)
	return e
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

// networkReasons are the words with which PouchDB Server reports an endpoint it could not
// reach, inside a 400 bad_request.
var networkReasons = []string{"ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "EHOSTUNREACH", "ENETUNREACH",
	"ENOTFOUND", "EAI_AGAIN", "EPIPE", "socket hang up", "network timeout", "request to "}

// classify tells what a failed replication means for its retry.
//
//   - 401/403, or CouchDB's unauthorized, forbidden, replication_auth_error (a 500 on 3.x):
//     permanent: the credentials of a source or target are wrong.
//   - db_not_found (CouchDB answers 500 for a missing source or target, or an endpoint that
//     answered an unexpected status): dbNotFound.
//   - 400: permanent (a bad parameter, a bad URL), unless the reason says an endpoint could
//     not be reached (PouchDB Server answers 400 "request to ... failed, reason: connect
//     ECONNREFUSED"): transient.
//   - 404, 405, 409, 412, 413, 415: permanent (e.g. a filter that does not exist).
//   - everything else (5xx, 429, no answer, timeout): transient.
func classify(err error) failureKind {
	var re *replicateError
	if !errors.As(err, &re) {
		return transient
	}
	switch re.ErrorName {
	case "unauthorized", "forbidden", "replication_auth_error":
		return permanent
	case "db_not_found":
		return dbNotFound
	}
	switch re.Status {
	case http.StatusUnauthorized, http.StatusForbidden:
		return permanent
	case http.StatusBadRequest:
		for _, w := range networkReasons {
			if strings.Contains(re.Reason, w) {
				return transient
			}
		}
		return permanent
	case http.StatusNotFound, http.StatusMethodNotAllowed, http.StatusConflict, http.StatusPreconditionFailed,
		http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType:
		return permanent
	}
	return transient
}

// authStatus returns 401 or 403 when err says the credentials of a source or target were
// refused, whatever status carried it (CouchDB 3 answers a wrong endpoint password with 500
// replication_auth_error), and 0 otherwise.
func authStatus(err error) int {
	var re *replicateError
	if !errors.As(err, &re) {
		return 0
	}
	switch {
	case re.ErrorName == "forbidden" || re.Status == http.StatusForbidden:
		return http.StatusForbidden
	case re.ErrorName == "unauthorized" || re.ErrorName == "replication_auth_error" || re.Status == http.StatusUnauthorized:
		return http.StatusUnauthorized
	}
	return 0
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
