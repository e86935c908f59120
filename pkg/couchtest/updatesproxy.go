package couchtest

import (
	"context"
	"encoding/json"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// DefaultCoalesceWindow is how long an UpdatesProxy gathers writes before their _db_updates rows
// get seqs (CouchDB 3's max_write_delay is 500 ms; shorter keeps tests fast).
const DefaultCoalesceWindow = 100 * time.Millisecond

// UpdatesProxy is an HTTP proxy in front of the test server that gives it a CouchDB-3-like
// _db_updates feed with real positions, so that position-saving code can be tested on PouchDB
// Server, which has neither _db_updates nor POST /_dbs_info.
//
// It forwards every request as it is (any method, bodies streamed both ways, continuous feeds
// flushed as they come, Basic auth kept, no gzip asked of the server). When the server has its
// own _db_updates (Apache CouchDB) it forwards that too and is a plain proxy, still useful for
// Cut and Restore. Otherwise (Synthetic) it serves GET /_db_updates and POST /_dbs_info itself:
//   - The feed holds the db changes of the requests it forwarded that succeeded (2xx): PUT /{db}
//     is created, DELETE /{db} deleted, a doc, design doc, attachment, _bulk_docs, _purge or
//     _index write updated; reads, _local docs and '_' endpoints are none. Writes that bypass
//     the proxy (straight to the server, or made by the server itself, e.g. _replicate) are not
//     seen.
//   - As in CouchDB 3, writes gather for the coalescing window and each (type, db) is one row,
//     at the seq of its latest write. Every observed write is followed, before its answer
//     reaches the client, by a pending row that gets a seq after every seq handed out so far.
//     The rows of one window get their seqs in the order of the writes (CouchDB: any order).
//   - Seqs are opaque strings ("3-g1AAAA…") that only this proxy accepts back as since; any
//     other since but "now", "0" and none is a 400, as in CouchDB.
//   - feed=normal, longpoll and continuous with since, limit, timeout and heartbeat answer in
//     CouchDB 3.3's shapes; POST /_dbs_info reads each db with GET /{db} from the server.
//
// All methods are safe for concurrent use. Everything it started stops when the test ends.
type UpdatesProxy struct {
	upstream  *Server
	target    *url.URL // the server's scheme and host
	prefix    string   // the server URL's path, if any: stripped from request paths
	addr      string   // host:port the proxy listens on
	synthetic bool
	log       *updatesLog // nil unless synthetic
	rp        *httputil.ReverseProxy
	transport *http.Transport // to the server
	through   *Server

	mu       sync.Mutex
	srv      *http.Server // nil while cut
	cut      context.CancelFunc
	closed   bool
	handlers sync.WaitGroup // ServeHTTP calls in progress
	serving  sync.WaitGroup // Serve loops

	writes   atomic.Int64
	gate     atomic.Pointer[chan struct{}] // while set, feed requests with a since wait for it to close (HoldFeeds)
	waiting  atomic.Int64                  // feed requests waiting for gate
	reqMu    sync.Mutex
	requests []proxiedRequest // every request received
}

// UpdatesProxyOption tunes NewUpdatesProxy.
type UpdatesProxyOption func(*updatesProxyConfig)

type updatesProxyConfig struct {
	window     time.Duration
	synthesize bool
}

// CoalesceWindow sets how long writes gather before their rows get seqs (default
// DefaultCoalesceWindow). 0 gives each write its row's new seq before its answer is forwarded.
func CoalesceWindow(d time.Duration) UpdatesProxyOption {
	return func(c *updatesProxyConfig) { c.window = max(d, 0) }
}

// AlwaysSynthesize makes the proxy serve its own _db_updates and _dbs_info even when the server
// has them, so that the synthesized feed can be checked against Apache CouchDB too.
func AlwaysSynthesize() UpdatesProxyOption {
	return func(c *updatesProxyConfig) { c.synthesize = true }
}

// NewUpdatesProxy starts an UpdatesProxy in front of s on a free local port. It probes
// GET /_db_updates?feed=normal&limit=1 with s's credentials: 200 means the server has its own
// feed. It fails the test when the server does not answer; the proxy stops when the test ends.
func (s *Server) NewUpdatesProxy(t testing.TB, opts ...UpdatesProxyOption) *UpdatesProxy {
	t.Helper()
	cfg := updatesProxyConfig{window: DefaultCoalesceWindow}
	for _, o := range opts {
		o(&cfg)
	}
	u, err := url.Parse(s.URL)
	if err != nil {
		t.Fatalf("couchtest: parse URL: %v", err)
	}
	p := &UpdatesProxy{
		upstream:  s,
		target:    &url.URL{Scheme: u.Scheme, Host: u.Host},
		prefix:    strings.TrimRight(u.EscapedPath(), "/"),
		synthetic: cfg.synthesize || !hasDBUpdates(t, s),
		transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
			DisableCompression:  true, // PouchDB Server stalls gzipped continuous feeds
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     idleConnTimeout,
		},
	}
	if p.synthetic {
		p.log = newUpdatesLog(cfg.window)
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite:        func(r *httputil.ProxyRequest) { r.SetURL(p.target) },
		Transport:      p.transport,
		FlushInterval:  -1,
		ModifyResponse: p.observe,
		ErrorHandler:   proxyError,
		ErrorLog:       log.New(io.Discard, "", 0),
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("couchtest: updates proxy listen: %v", err)
	}
	p.addr = ln.Addr().String()
	p.through = p.newThroughServer(t)
	p.serve(ln)
	t.Cleanup(p.close)
	return p
}

// hasDBUpdates probes the server for its own _db_updates.
func hasDBUpdates(t testing.TB, s *Server) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/_db_updates?feed=normal&limit=1", nil)
	if err != nil {
		t.Fatalf("couchtest: probe _db_updates: %v", err)
	}
	resp, err := s.HTTP.Do(req)
	if err != nil {
		t.Fatalf("couchtest: probe _db_updates: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func (p *UpdatesProxy) newThroughServer(t testing.TB) *Server {
	t.Helper()
	s := newServer(t, p.URL())
	s.PouchDB, s.Version, s.Cluster = p.upstream.PouchDB, p.upstream.Version, p.upstream.Cluster
	s.writeAll.Store(p.upstream.writeAll.Load())
	return s
}

// URL returns the server's URL, credentials included, with its host replaced by the proxy's.
func (p *UpdatesProxy) URL() string {
	u, _ := url.Parse(p.upstream.URL) // parsed in NewUpdatesProxy
	u.Host = p.addr
	return u.String()
}

// Server returns a Server whose URL, Client and HTTP go through the proxy, so that its writes
// are observed. Dbs it creates are deleted through the proxy when the test ends: Restore a cut
// proxy before then, or they stay on the server.
func (p *UpdatesProxy) Server() *Server { return p.through }

// Synthetic reports whether the proxy serves its own _db_updates and _dbs_info (the server has
// no _db_updates, or AlwaysSynthesize) rather than forwarding them.
func (p *UpdatesProxy) Synthetic() bool { return p.synthetic }

// Writes returns how many forwarded requests made a db change (see UpdatesProxy), in either mode.
func (p *UpdatesProxy) Writes() int { return int(p.writes.Load()) }

// Events returns the last seq number of the synthesized feed: how many rows got a seq, rows
// since superseded included. It is 0 when the proxy is not Synthetic.
func (p *UpdatesProxy) Events() int {
	if p.log == nil {
		return 0
	}
	return int(p.log.last())
}

// Flush gives the rows of the writes gathered so far their seqs now instead of at the end of
// the coalescing window. It does nothing when the proxy is not Synthetic.
func (p *UpdatesProxy) Flush() {
	if p.log != nil {
		p.log.flush()
	}
}

// Hold keeps the rows of writes from now on out of the synthesized feed until Release: a
// _db_updates feed that is late by as long as the test needs. It does nothing when the proxy is
// not Synthetic.
func (p *UpdatesProxy) Hold() {
	if p.log != nil {
		p.log.hold()
	}
}

// HoldFeeds makes the synthesized _db_updates requests that carry a since (a feed being
// opened or resumed, not a probe) wait until the returned release is called or their request
// ends: a feed that connects as late as the test needs. It does nothing when the proxy is not
// Synthetic; release may be called more than once.
func (p *UpdatesProxy) HoldFeeds() (release func()) {
	ch := make(chan struct{})
	p.gate.Store(&ch)
	var once sync.Once
	return func() {
		once.Do(func() {
			p.gate.CompareAndSwap(&ch, nil)
			close(ch)
		})
	}
}

// FeedsWaiting returns how many feed requests HoldFeeds keeps waiting now.
func (p *UpdatesProxy) FeedsWaiting() int { return int(p.waiting.Load()) }

// Release ends Hold: the rows held get their seqs now.
func (p *UpdatesProxy) Release() {
	if p.log != nil {
		p.log.release()
	}
}

// proxiedRequest is what UpdatesProxy records of a request: its method, escaped path relative
// to the server URL, and raw query.
type proxiedRequest struct{ method, path, query string }

// Requests returns how many requests the proxy received, whatever their outcome, whose method is
// method ("" for any) and whose escaped path, relative to the server URL, starts with pathPrefix.
func (p *UpdatesProxy) Requests(method, pathPrefix string) int {
	return len(p.Queries(method, pathPrefix))
}

// Queries returns the query parameters of the requests Requests counts, in the order received.
func (p *UpdatesProxy) Queries(method, pathPrefix string) []url.Values {
	p.reqMu.Lock()
	defer p.reqMu.Unlock()
	var out []url.Values
	for _, r := range p.requests {
		if (method == "" || r.method == method) && strings.HasPrefix(r.path, pathPrefix) {
			q, _ := url.ParseQuery(r.query)
			out = append(out, q)
		}
	}
	return out
}

// Cut closes the listener and every open connection, streaming feeds included: clients see
// their requests fail and new connections refused until Restore. Cutting a cut proxy does
// nothing.
func (p *UpdatesProxy) Cut() {
	p.mu.Lock()
	srv, cut := p.srv, p.cut
	p.srv, p.cut = nil, nil
	p.mu.Unlock()
	if srv != nil {
		cut()
		_ = srv.Close()
	}
}

// Restore listens again on the same address. It fails the test when the address cannot be
// taken (e.g. the proxy was not cut).
func (p *UpdatesProxy) Restore(t testing.TB) {
	t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		t.Fatalf("couchtest: updates proxy relisten on %s: %v", p.addr, err)
	}
	p.serve(ln)
}

// serve serves ln until the next Cut. Requests of this period see their context canceled by it.
func (p *UpdatesProxy) serve(ln net.Listener) {
	period, cut := context.WithCancel(context.Background())
	srv := &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { p.handle(period, w, r) }),
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          log.New(io.Discard, "", 0),
	}
	p.mu.Lock()
	if p.closed || p.srv != nil {
		p.mu.Unlock()
		cut()
		_ = ln.Close()
		return
	}
	p.srv, p.cut = srv, cut
	p.serving.Add(1)
	p.mu.Unlock()
	go func() {
		defer p.serving.Done()
		_ = srv.Serve(ln)
	}()
}

// close stops everything the proxy started and waits for it.
func (p *UpdatesProxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.Cut()
	p.handlers.Wait()
	p.serving.Wait()
	if p.log != nil {
		p.log.close()
	}
	p.transport.CloseIdleConnections()
	p.through.HTTP.CloseIdleConnections()
}

type writeKey struct{}

func (p *UpdatesProxy) handle(period context.Context, w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		writeJSONError(w, http.StatusServiceUnavailable, "unavailable", "couchtest: the updates proxy is closed")
		return
	}
	p.handlers.Add(1)
	p.mu.Unlock()
	defer p.handlers.Done()

	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(period, cancel)() // Cut ends the request
	r = r.WithContext(ctx)

	path := strings.TrimPrefix(r.URL.EscapedPath(), p.prefix)
	p.reqMu.Lock()
	p.requests = append(p.requests, proxiedRequest{method: r.Method, path: path, query: r.URL.RawQuery})
	p.reqMu.Unlock()
	if p.synthetic {
		switch {
		case path == "/_db_updates":
			p.serveDBUpdates(w, r)
			return
		case path == "/_dbs_info" && r.Method == http.MethodPost:
			p.serveDBsInfo(w, r)
			return
		}
	}
	if op, ok := classifyWrite(r.Method, path); ok {
		r = r.WithContext(context.WithValue(ctx, writeKey{}, op))
	}
	p.rp.ServeHTTP(w, r)
}

// observe records the db change of a successful write, before its answer is forwarded.
func (p *UpdatesProxy) observe(resp *http.Response) error {
	op, ok := resp.Request.Context().Value(writeKey{}).(dbWrite)
	if !ok || resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil
	}
	p.writes.Add(1)
	if p.log != nil {
		p.log.record(op.db, op.typ)
	}
	return nil
}

// proxyError answers 502 when the server cannot be reached, unless the client is gone.
func proxyError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		return
	}
	writeJSONError(w, http.StatusBadGateway, "bad_gateway", "couchtest: updates proxy: "+err.Error())
}

// writeJSONError answers status with CouchDB's {"error","reason"} body.
func writeJSONError(w http.ResponseWriter, status int, name, reason string) {
	body, _ := json.Marshal(map[string]string{"error": name, "reason": reason})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}
