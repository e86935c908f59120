package couch

import (
	"context"
	"errors"
	"net/http"
	"strings"
)

// Class is what a failed exchange with CouchDB means for the caller: every part of the service
// (the producer's feeds, both consumers, the native replication engine) decides with it whether
// to retry, give up or report.
type Class int

const (
	// Transient failures may go away by themselves: no answer, a timeout, 5xx, 429, a server
	// that could not reach another one. Retry with backoff.
	Transient Class = iota
	// Permanent failures will not: a request the server refuses as such (400 with a reason, 405,
	// 409, 412, 413, 415). Retrying cannot help; report.
	Permanent
	// NotFound: the db or doc does not exist (404, not_found, db_not_found).
	NotFound
	// Auth: the credentials are refused (401, 403, unauthorized, forbidden, and CouchDB 3's 500
	// replication_auth_error, unless its session request only failed to get an answer).
	// Retrying cannot help until they are fixed.
	Auth
)

func (c Class) String() string {
	switch c {
	case Permanent:
		return "permanent"
	case NotFound:
		return "not found"
	case Auth:
		return "auth"
	}
	return "transient"
}

// unreachableReasons are the words with which PouchDB Server reports, inside a 400, an endpoint
// it could not reach (its _replicate): such a 400 is transient.
var unreachableReasons = []string{"ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "EHOSTUNREACH", "ENETUNREACH",
	"ENOTFOUND", "EAI_AGAIN", "EPIPE", "socket hang up", "network timeout", "request to "}

// Classify returns the class of err: that of the *HTTPError in its chain (by CouchDB's error name
// first, then by status), Transient for anything else (no answer, a context that ended, an
// answer that did not decode). nil is Transient too; callers classify errors only.
func Classify(err error) Class {
	var he *HTTPError
	if !errors.As(err, &he) {
		return Transient
	}
	switch he.ErrorName {
	case "replication_auth_error":
		// CouchDB's replicator could not get a session: refused credentials say
		// session_request_unauthorized (or _forbidden); session_request_failed is a session
		// request that got no answer (connection closed or refused, timeout): transient.
		if strings.Contains(he.Reason, "session_request_failed") {
			return Transient
		}
		return Auth
	case "unauthorized", "forbidden":
		return Auth
	case "not_found", "db_not_found":
		return NotFound
	}
	switch he.Status {
	case http.StatusUnauthorized, http.StatusForbidden:
		return Auth
	case http.StatusNotFound:
		return NotFound
	case http.StatusBadRequest:
		for _, w := range unreachableReasons {
			if strings.Contains(he.Reason, w) {
				return Transient
			}
		}
		return Permanent
	case http.StatusMethodNotAllowed, http.StatusConflict, http.StatusPreconditionFailed,
		http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType:
		return Permanent
	}
	return Transient
}

// retryable reports whether one more attempt of an idempotent request may succeed: no answer
// (but not a context that ended), 5xx or 429.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	var he *HTTPError
	if errors.As(err, &he) {
		return he.Status >= 500 || he.Status == http.StatusTooManyRequests
	}
	return true
}
