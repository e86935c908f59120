package e2e

import (
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
)

// countingProxy sits between one process and CouchDB and counts the requests it forwards by
// endpoint (see endpoint) and the connections open at once. Continuous feeds stream through.
type countingProxy struct {
	*httptest.Server
	spiegelDB string

	mu       sync.Mutex
	counts   map[string]int
	conns    int
	maxConns int
}

func newCountingProxy(t testing.TB, upstream, spiegelDB string) *countingProxy {
	t.Helper()
	u, err := url.Parse(upstream)
	if err != nil {
		t.Fatalf("upstream URL: %v", err)
	}
	p := &countingProxy{spiegelDB: spiegelDB, counts: map[string]int{}}
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.Out.URL.Scheme, r.Out.URL.Host, r.Out.Host = u.Scheme, u.Host, u.Host
		},
		FlushInterval: -1,
		Transport:     &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 256},
		// A process that stops reading (a hot feed closed, a request given up) is no news.
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, _ error) { w.WriteHeader(http.StatusBadGateway) },
	}
	p.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.counts[endpoint(r.Method, r.URL.EscapedPath(), r.URL.Query().Get("feed"), spiegelDB)]++
		p.mu.Unlock()
		rp.ServeHTTP(w, r)
	}))
	p.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		p.mu.Lock()
		defer p.mu.Unlock()
		switch s {
		case http.StateNew:
			p.conns++
			p.maxConns = max(p.maxConns, p.conns)
		case http.StateClosed, http.StateHijacked:
			p.conns--
		}
	}
	p.Start()
	t.Cleanup(p.Close)
	return p
}

// URL returns the proxy's URL with the credentials of upstream.
func (p *countingProxy) urlFor(upstream string) string {
	u, _ := url.Parse(upstream)
	pu, _ := url.Parse(p.Server.URL)
	u.Host = pu.Host
	return u.String()
}

// snapshot returns the counts so far and the connections open now; resetMax starts a new
// maximum from the connections open now, returned as the maximum since the last reset.
func (p *countingProxy) snapshot(resetMax bool) (counts map[string]int, open, maxOpen int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	counts, open, maxOpen = maps.Clone(p.counts), p.conns, p.maxConns
	if resetMax {
		p.maxConns = p.conns
	}
	return counts, open, maxOpen
}

// endpoint names the CouchDB endpoint of a request: its method and path with db names and doc
// ids replaced by their kind ("db", "spiegel-db"), continuous _changes apart from normal ones.
func endpoint(method, escapedPath, feed, spiegelDB string) string {
	p := strings.TrimPrefix(escapedPath, "/")
	if p == "" {
		return method + " /"
	}
	first, rest, _ := strings.Cut(p, "/")
	if strings.HasPrefix(first, "_") {
		return method + " /" + first
	}
	db, err := url.PathUnescape(first)
	if err != nil {
		db = first
	}
	kind := "db"
	if db == spiegelDB {
		kind = "spiegel-db"
	}
	switch {
	case rest == "":
		return method + " " + kind
	case rest == "_changes" && feed == "continuous":
		return method + " " + kind + "/_changes?feed=continuous"
	case strings.HasPrefix(rest, "_local/"):
		return method + " " + kind + "/_local"
	case strings.HasPrefix(rest, "_design/"):
		return method + " " + kind + "/_design"
	case strings.HasPrefix(rest, "_"):
		name, _, _ := strings.Cut(rest, "/")
		return method + " " + kind + "/" + name
	default:
		return method + " " + kind + "/doc"
	}
}

// isWrite reports whether an endpoint (as endpoint names it) writes to CouchDB.
func isWrite(ep string) bool {
	method, path, _ := strings.Cut(ep, " ")
	switch method {
	case http.MethodPut, http.MethodDelete:
		return true
	case http.MethodPost:
		return strings.HasSuffix(path, "/_bulk_docs") || path == "db" || path == "spiegel-db" ||
			strings.HasSuffix(path, "/_purge") || strings.HasSuffix(path, "/_compact")
	}
	return false
}

func TestEndpoint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		method, path, feed, want string
		write                    bool
	}{
		{"GET", "/", "", "GET /", false},
		{"GET", "/_db_updates", "continuous", "GET /_db_updates", false},
		{"POST", "/_dbs_info", "", "POST /_dbs_info", false},
		{"GET", "/user_1", "", "GET db", false},
		{"PUT", "/user_1", "", "PUT db", true},
		{"GET", "/user_1/_changes", "normal", "GET db/_changes", false},
		{"GET", "/user_1/_changes", "continuous", "GET db/_changes?feed=continuous", false},
		{"POST", "/a%2Fb/_revs_diff", "", "POST db/_revs_diff", false},
		{"POST", "/user_1/_bulk_get", "", "POST db/_bulk_get", false},
		{"POST", "/user_1/_bulk_docs", "", "POST db/_bulk_docs", true},
		{"GET", "/user_1/_local/abc", "", "GET db/_local", false},
		{"PUT", "/user_1/_local/abc", "", "PUT db/_local", true},
		{"GET", "/spiegel/_local/x", "", "GET spiegel-db/_local", false},
		{"PUT", "/spiegel/producer_position", "", "PUT spiegel-db/doc", true},
		{"GET", "/spiegel/_changes", "longpoll", "GET spiegel-db/_changes", false},
		{"GET", "/user_1/_design/x/_view/y", "", "GET db/_design", false},
		{"PUT", "/user_1/doc%2F1", "", "PUT db/doc", true},
		{"DELETE", "/user_1/d", "", "DELETE db/doc", true},
	} {
		got := endpoint(tc.method, tc.path, tc.feed, "spiegel")
		if got != tc.want {
			t.Errorf("endpoint(%s %s feed=%s) = %q, want %q", tc.method, tc.path, tc.feed, got, tc.want)
		}
		if isWrite(got) != tc.write {
			t.Errorf("isWrite(%q) = %v, want %v", got, !tc.write, tc.write)
		}
	}
}
