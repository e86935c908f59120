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

// ErrNotFound matches (errors.Is) every *HTTPError of class NotFound: a missing db or doc.
var ErrNotFound = errors.New("couch: not found")

// ErrPermanent matches (errors.Is) every *HTTPError that retrying cannot fix: class Permanent
// (e.g. a malformed since) or Auth (credentials). Feeds return such errors instead of
// reconnecting.
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

// Is reports whether e matches ErrNotFound or ErrPermanent (see Classify).
func (e *HTTPError) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return Classify(e) == NotFound
	case ErrPermanent:
		c := Classify(e)
		return c == Permanent || c == Auth
	}
	return false
}

// DBMissing reports whether e is a 404 that says the db does not exist: "Database does not
// exist." (CouchDB 2+), "no_db_file" (CouchDB 1.x, PouchDB Server). A doc's 404 in a db that
// exists says "missing"; any other 404 (a proxy's, say) tells nothing.
func (e *HTTPError) DBMissing() bool {
	return e.Status == http.StatusNotFound && dbMissing(e.Reason)
}

func dbMissing(reason string) bool {
	return strings.Contains(reason, "Database does not exist") || strings.Contains(reason, "no_db_file")
}

// IsPermanent reports whether err is an *HTTPError that retrying cannot fix (classes Permanent
// and Auth).
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
	data, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	var body struct {
		Error  string          `json:"error"`
		Reason json.RawMessage `json:"reason"` // a string, or a JSON term (CouchDB's _replicate)
	}
	if json.Unmarshal(data, &body) == nil {
		he.ErrorName = body.Error
		if err := json.Unmarshal(body.Reason, &he.Reason); err != nil && len(body.Reason) > 0 {
			he.Reason = string(body.Reason)
		}
	} else if s := strings.TrimSpace(string(data)); s != "" {
		he.Reason = truncate([]byte(s), 300) // e.g. an HTML error page of a crashed PouchDB Server
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
