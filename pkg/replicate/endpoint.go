package replicate

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

// endpoint is one side of a replication: a db on a server, addressed by a full URL. Requests
// carry the URL's credentials as a Basic Authorization header, never in the URL; errors are
// *couch.HTTPError (errors.Is(err, couch.ErrNotFound) for 404) or redacted transport errors.
// It is safe for concurrent use.
type endpoint struct {
	hc     *http.Client
	base   string // scheme://host[/prefix], no credentials, no trailing slash
	db     string // decoded name
	dbPath string // "/" + the name escaped as one path segment
	user   *url.Userinfo
	shown  string // the full URL with its password redacted: safe for logs and errors
}

// newEndpoint parses a db URL ("http://user:pw@host:5984/prefix/db"): the last path segment,
// URL-decoded, is the db name; what precedes it is the server.
func newEndpoint(raw string, hc *http.Client) (*endpoint, error) {
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
	base := url.URL{Scheme: strings.ToLower(u.Scheme), Host: strings.ToLower(u.Host)}
	return &endpoint{
		hc:     hc,
		base:   base.String() + escaped[:i],
		db:     db,
		dbPath: "/" + couchpath.Segment(db),
		user:   u.User,
		shown:  shown,
	}, nil
}

// docPath returns the escaped request path of a doc of the db; "_design/x" keeps its slash.
func (e *endpoint) docPath(id string) string {
	if rest, ok := strings.CutPrefix(id, "_design/"); ok {
		return e.dbPath + "/_design/" + couchpath.Segment(rest)
	}
	return e.dbPath + "/" + couchpath.Segment(id)
}

// do sends one request to path (escaped, from the server root, see dbPath) and decodes a JSON
// answer into out (nil: discard). body is nil, []byte sent as is, or a value encoded as JSON.
// Connection failures and 5xx/429 answers are retried (maxAttempts in all); a status >= 300 is
// returned as a *couch.HTTPError.
func (e *endpoint) do(ctx context.Context, method, path string, query url.Values, body any, out any) error {
	var data []byte
	switch b := body.(type) {
	case nil:
	case []byte:
		data = b
	default:
		var err error
		if data, err = json.Marshal(body); err != nil {
			return fmt.Errorf("encode body of %s %s: %w", method, path, err)
		}
	}
	var err error
	for attempt := 1; ; attempt++ {
		var retry bool
		retry, err = e.once(ctx, method, path, query, data, body != nil, out)
		if err == nil || !retry || attempt >= maxAttempts || ctx.Err() != nil {
			return err
		}
		if serr := backoff.Sleep(ctx, retryPolicy.Delay(attempt)); serr != nil {
			return err
		}
	}
}

// once sends the request one time; retry tells whether a failure is worth another attempt.
func (e *endpoint) once(ctx context.Context, method, path string, query url.Values, data []byte, hasBody bool, out any) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	target := e.base + path
	if len(query) > 0 {
		target += "?" + query.Encode()
	}
	var rd io.Reader
	if hasBody {
		rd = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, target, rd)
	if err != nil {
		return false, fmt.Errorf("build request %s %s: %s", method, path, logging.RedactText(err.Error()))
	}
	e.authorize(req)
	req.Header.Set("Accept", "application/json")
	if hasBody {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := e.hc.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its message would repeat the URL
		}
		return true, &transportError{msg: logging.RedactText(fmt.Sprintf("%s %s: %v", method, path, err)), err: err}
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		_ = resp.Body.Close()
	}()
	if resp.StatusCode >= 300 {
		he := &couch.HTTPError{Status: resp.StatusCode, Method: method, Path: path}
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		var eb struct {
			Error  string `json:"error"`
			Reason string `json:"reason"`
		}
		if json.Unmarshal(raw, &eb) == nil {
			he.ErrorName, he.Reason = eb.Error, eb.Reason
		}
		return resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests, he
	}
	if out == nil {
		return false, nil
	}
	if rd, ok := out.(responseDecoder); ok {
		err = rd.decodeResponse(resp.Header.Get("Content-Type"), resp.Body)
	} else {
		err = json.NewDecoder(resp.Body).Decode(out)
	}
	if err != nil {
		return true, &transportError{msg: fmt.Sprintf("decode answer of %s %s: %v", method, path, err), err: err}
	}
	return false, nil
}

// authorize sets the request's Basic Authorization from the URL's credentials, if any.
func (e *endpoint) authorize(req *http.Request) {
	if e.user != nil {
		pw, _ := e.user.Password()
		req.SetBasicAuth(e.user.Username(), pw)
	}
}

// responseDecoder is an answer that decodes itself from its content type and body (an out
// argument of endpoint.do that is not plain JSON).
type responseDecoder interface {
	decodeResponse(contentType string, body io.Reader) error
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

// transportError is a failed exchange (connection, decoding); its message is redacted.
type transportError struct {
	msg string
	err error
}

func (e *transportError) Error() string { return e.msg }
func (e *transportError) Unwrap() error { return e.err }

// countingTransport counts every request sent through it (retries included).
type countingTransport struct {
	base http.RoundTripper
	n    *atomic.Int64
}

func (t countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t.n.Add(1)
	return t.base.RoundTrip(req)
}

// countingClient returns a client over hc's transport (or a fresh one without compression,
// which stalls PouchDB Server feeds) that adds each request to n, and the function that
// releases what it created (idle connections of a fresh transport).
func countingClient(hc *http.Client, n *atomic.Int64) (*http.Client, func()) {
	var base http.RoundTripper
	out := &http.Client{}
	if hc != nil {
		*out = *hc
		base = hc.Transport
	}
	release := func() {}
	if base == nil {
		tr := &http.Transport{
			Proxy:               http.ProxyFromEnvironment,
			DisableCompression:  true,
			MaxIdleConns:        64,
			MaxIdleConnsPerHost: 32,
			IdleConnTimeout:     90 * time.Second,
		}
		base, release = tr, tr.CloseIdleConnections
	}
	out.Transport = countingTransport{base: base, n: n}
	return out, release
}
