package replicate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchpath"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// requestTimeout bounds one HTTP request (bulk requests included); the run's ctx bounds them all.
const requestTimeout = 2 * time.Minute

// maxAttempts is how often an idempotent request is tried when the connection fails or the
// server answers 5xx/429. Every request of the protocol is idempotent: reads, _revs_diff,
// _bulk_get, _bulk_docs with new_edits=false, and checkpoint PUTs (a stale _rev is a 409).
const maxAttempts = 3

var retryPolicy = backoff.Policy{Initial: 200 * time.Millisecond, Max: 2 * time.Second, Multiplier: 2, Jitter: 0.2}

// endpoint is one side of a replication: a db on a server, addressed by a full URL, reached
// through a couch.Client of that server (credentials as a Basic Authorization header, never in
// the URL; errors are *couch.HTTPError — see couch.Classify — or redacted transport errors). It
// is safe for concurrent use.
type endpoint struct {
	c      *couch.Client
	db     string // decoded name
	dbPath string // "/" + the name escaped as one path segment
	shown  string // the full URL with its password redacted: safe for logs and errors
}

// sameServer reports whether e and o are dbs of one server (scheme and host of their base URLs).
func (e *endpoint) sameServer(o *endpoint) bool {
	a, b := e.c.BaseURL(), o.c.BaseURL()
	return a.Scheme == b.Scheme && a.Host == b.Host
}

// newEndpoint parses a db URL ("http://user:pw@host:5984/prefix/db"): the last path segment,
// URL-decoded, is the db name; what precedes it is the server, reached over tr (streams over
// streamTr, see couch.Config.StreamTransport).
func newEndpoint(raw string, tr, streamTr http.RoundTripper) (*endpoint, error) {
	shown := logging.RedactURL(raw)
	u, err := url.Parse(strings.TrimRight(raw, "/"))
	if err != nil {
		return nil, fmt.Errorf("db url %q does not parse", logging.RedactText(raw))
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("db url %q: want http(s)://host/db", shown)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("db url %q: must not have a query or fragment", shown)
	}
	escaped := u.EscapedPath()
	i := strings.LastIndex(escaped, "/")
	if i < 0 || i == len(escaped)-1 {
		return nil, fmt.Errorf("db url %q: no db name in the path", shown)
	}
	db, err := url.PathUnescape(escaped[i+1:])
	if err != nil || db == "" {
		return nil, fmt.Errorf("db url %q: bad db name", shown)
	}
	server := url.URL{Scheme: strings.ToLower(u.Scheme), User: u.User, Host: strings.ToLower(u.Host), RawPath: escaped[:i]}
	if server.Path, err = url.PathUnescape(escaped[:i]); err != nil {
		return nil, fmt.Errorf("db url %q: bad path", shown)
	}
	c, err := couch.New(couch.Config{URL: server.String(), Transport: tr, StreamTransport: streamTr, RequestTimeout: requestTimeout}, nil)
	if err != nil {
		return nil, fmt.Errorf("db url %q: %w", shown, err)
	}
	return &endpoint{c: c, db: db, dbPath: "/" + couchpath.Segment(db), shown: shown}, nil
}

// docPath returns the escaped request path of a doc of the db; "_design/x" keeps its slash.
func (e *endpoint) docPath(id string) string {
	if rest, ok := strings.CutPrefix(id, "_design/"); ok {
		return e.dbPath + "/_design/" + couchpath.Segment(rest)
	}
	return e.dbPath + "/" + couchpath.Segment(id)
}

// do sends one request to path (escaped, from the server root, see dbPath) and decodes a JSON
// answer into out (nil: discard; a couch.ResponseDecoder decodes itself). body is nil, []byte
// sent as is, or a value encoded as JSON. Every request of the protocol is idempotent, so
// connection failures and 5xx/429 answers are retried (couch.Client.DoIdempotent).
func (e *endpoint) do(ctx context.Context, method, path string, query url.Values, body any, out any) error {
	return e.c.DoIdempotent(ctx, method, path, query, body, out)
}

// exists reports whether the db exists (HEAD /db).
func (e *endpoint) exists(ctx context.Context) (bool, error) {
	err := e.do(ctx, http.MethodHead, e.dbPath, nil, nil, nil)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, couch.ErrNotFound):
		return false, nil
	default:
		return false, fmt.Errorf("check db %s: %w", e.shown, err)
	}
}

// create creates the db; one that already exists (412) is fine.
func (e *endpoint) create(ctx context.Context) error {
	err := e.do(ctx, http.MethodPut, e.dbPath, nil, nil, nil)
	var he *couch.HTTPError
	if err == nil || errors.As(err, &he) && he.Status == http.StatusPreconditionFailed {
		return nil
	}
	return fmt.Errorf("create db %s: %w", e.shown, err)
}

// countingTransport counts every request sent through it (retries included).
type countingTransport struct {
	base http.RoundTripper
	n    *atomic.Int64
}

func (t countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t.n.Add(1)
	return t.base.RoundTrip(req)
}

// countingTransportOf returns a transport over hc's (or a fresh one, see couch.NewTransport)
// that adds each request to n, and the function that releases what it created (idle
// connections of a fresh transport).
func countingTransportOf(hc *http.Client, n *atomic.Int64) (http.RoundTripper, func(), error) {
	if hc != nil && hc.Transport != nil {
		return countingTransport{base: hc.Transport, n: n}, func() {}, nil
	}
	tr, err := couch.NewTransport(couch.Config{})
	if err != nil {
		return nil, nil, err
	}
	return countingTransport{base: tr, n: n}, tr.CloseIdleConnections, nil
}
