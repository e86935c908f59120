package couch

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// maxErrorBody is how much of an error answer's body the client reads: CouchDB's
// {"error","reason"} is small.
const maxErrorBody = 64 << 10

// errorAnswers carries every request of the client, kivik's and the streams' included. An
// answer with a status of 400 or more is read whole (maxErrorBody at most) and handed on with
// the credentials it quotes redacted, and the connection that carried it is closed when it may
// carry an answer more than asked for (see unsure).
//
// Both come from CouchDB 3.3.3 answering a _changes request on a db deleted while it was read
// (fabric_rpc:changes killed) twice: the changes callback's 500, then, once
// fabric_view_changes:go/5 failed to match that answer as its collector (badmatch
// delayed_resp), the request handler's own 500, whose reason dumps the request, its
// Authorization header included. Every later request on that keep-alive connection got the
// answer of the request before it: other dbs' revisions, which a replication then wrote into
// its target. CouchDB's main branch (2026-08) has the same code.
type errorAnswers struct{ base http.RoundTripper }

// RoundTrip implements http.RoundTripper.
func (t errorAnswers) RoundTrip(req *http.Request) (*http.Response, error) {
	var conn net.Conn
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) { conn = i.Conn },
	}))
	resp, err := t.base.RoundTrip(req)
	if err != nil || resp.StatusCode < 400 {
		return resp, err
	}
	data, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	_ = resp.Body.Close()
	if conn != nil && unsure(resp.StatusCode, data) {
		_ = conn.Close()
	}
	data = []byte(logging.RedactText(string(data)))
	resp.Body = io.NopCloser(bytes.NewReader(data))
	resp.ContentLength = int64(len(data))
	resp.Header.Del("Content-Length") // the redacted body may be shorter
	return resp, nil
}

// CloseIdleConnections passes the call on (http.Client.CloseIdleConnections reaches the pool
// only through transports that have it).
func (t errorAnswers) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// unsure reports whether the connection that carried an answer of status with body must not
// carry another request: a server error, or a db that is gone.
func unsure(status int, body []byte) bool {
	return status >= 500 || status == http.StatusNotFound && dbMissing(string(body))
}
