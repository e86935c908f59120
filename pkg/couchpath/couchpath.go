// Package couchpath escapes the parts of CouchDB request paths. CouchDB 3 decodes a '+' in a
// path as a space, so a db named "a+b" must be sent as "a%2Bb"; url.PathEscape (and libraries
// built on it, kivik among them) leaves '+' as it is. Every request path the service and its
// tests send goes through Segment or through a PlusSafe transport.
package couchpath

import (
	"net/http"
	"net/url"
	"strings"
)

// Segment escapes s (a db name, a doc id, an attachment name) as one URL path segment for
// CouchDB: as url.PathEscape does ('/' becomes %2F), and '+' becomes %2B.
func Segment(s string) string {
	return strings.ReplaceAll(url.PathEscape(s), "+", "%2B")
}

// PlusSafe wraps next (http.DefaultTransport when nil) so that every request path it sends has
// its '+' escaped as %2B. A '+' means the same to servers that take it literally, such as
// PouchDB Server.
func PlusSafe(next http.RoundTripper) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return plusSafe{next: next}
}

type plusSafe struct{ next http.RoundTripper }

// CloseIdleConnections passes the call on (http.Client.CloseIdleConnections reaches the pool
// through it).
func (t plusSafe) CloseIdleConnections() {
	if c, ok := t.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (t plusSafe) RoundTrip(req *http.Request) (*http.Response, error) {
	path := req.URL.EscapedPath()
	if !strings.Contains(path, "+") {
		return t.next.RoundTrip(req)
	}
	r := *req // a RoundTripper must not change the caller's request
	u := *req.URL
	u.RawPath = strings.ReplaceAll(path, "+", "%2B")
	r.URL = &u
	return t.next.RoundTrip(&r)
}
