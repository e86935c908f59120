package couch

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// ErrNotFound matches (errors.Is) every *HTTPError with status 404: a missing db or doc.
var ErrNotFound = errors.New("couch: not found")

// ErrPermanent matches (errors.Is) every *HTTPError that retrying cannot fix: 400 (a bad
// request, e.g. a malformed since), 401 and 403 (credentials). Feeds return such errors instead
// of reconnecting.
var ErrPermanent = errors.New("couch: permanent error")

// HTTPError is an answer of the server with a status of 300 or more. It never holds
// credentials: Path is the request path without the base URL.
type HTTPError struct {
	Status    int
	ErrorName string // CouchDB's "error" field, e.g. "not_found"
	Reason    string // CouchDB's "reason" field
	Method    string
	Path      string
}

// Error implements error.
func (e *HTTPError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s: %d", e.Method, e.Path, e.Status)
	if e.ErrorName != "" {
		b.WriteString(" " + e.ErrorName)
	} else if t := http.StatusText(e.Status); t != "" {
		b.WriteString(" " + t)
	}
	if e.Reason != "" {
		b.WriteString(": " + e.Reason)
	}
	return logging.RedactText(b.String())
}

// Is reports whether e matches ErrNotFound (404) or ErrPermanent (400, 401, 403).
func (e *HTTPError) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return e.Status == http.StatusNotFound
	case ErrPermanent:
		return isPermanentStatus(e.Status)
	}
	return false
}

// Unauthorized reports whether the server refused the credentials (401 or 403).
func (e *HTTPError) Unauthorized() bool {
	return e.Status == http.StatusUnauthorized || e.Status == http.StatusForbidden
}

func isPermanentStatus(status int) bool {
	return status == http.StatusBadRequest || status == http.StatusUnauthorized ||
		status == http.StatusForbidden
}

// IsPermanent reports whether err is an *HTTPError that retrying cannot fix (400, 401, 403).
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

// httpStatus returns the status of the *HTTPError in err's chain, or 0.
func httpStatus(err error) int {
	var he *HTTPError
	if errors.As(err, &he) {
		return he.Status
	}
	return 0
}

// readHTTPError builds the *HTTPError for resp (status >= 300), reading at most 64 KiB of its
// body for CouchDB's {"error","reason"}.
func readHTTPError(resp *http.Response, method, path string) *HTTPError {
	he := &HTTPError{Status: resp.StatusCode, Method: method, Path: path}
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var body struct {
		Error  string `json:"error"`
		Reason string `json:"reason"`
	}
	if json.Unmarshal(data, &body) == nil {
		he.ErrorName, he.Reason = body.Error, body.Reason
	} else if s := strings.TrimSpace(string(data)); s != "" && len(s) < 200 {
		he.Reason = s
	}
	return he
}

// redactedError carries an error from a library (net/http, url) whose message may quote a URL:
// its message goes through logging.RedactText; errors.Is/As still see the original.
type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }

// redact returns err with a message that cannot hold a password; nil stays nil.
func redact(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := err.(*HTTPError); ok {
		return err // already redacted, and callers match it with errors.As
	}
	return &redactedError{msg: logging.RedactText(err.Error()), err: err}
}

// emitError marks an error returned by a caller's emit function, so that feed loops return it
// unchanged instead of reconnecting.
type emitError struct{ err error }

func (e *emitError) Error() string { return e.err.Error() }
func (e *emitError) Unwrap() error { return e.err }
