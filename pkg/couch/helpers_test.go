package couch

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
)

// fastRetry keeps reconnect tests quick; the policy's shape (capped, jittered) is unchanged.
var fastRetry = backoff.Policy{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond, Multiplier: 2, Jitter: 0.2}

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

func testLogger() (*logrus.Logger, *syncBuffer) {
	buf := &syncBuffer{}
	l := logrus.New()
	l.SetOutput(buf)
	l.SetLevel(logrus.DebugLevel)
	l.SetFormatter(&logrus.JSONFormatter{})
	return l, buf
}

// newTestClient returns a client for rawURL with fast reconnects and the log buffer.
func newTestClient(t *testing.T, rawURL string) (*Client, *syncBuffer) {
	t.Helper()
	l, buf := testLogger()
	c, err := New(Config{URL: rawURL, RequestTimeout: 5 * time.Second}, l)
	require.NoError(t, err)
	c.retry = fastRetry
	return c, buf
}

// fixtureBody returns the body of the exchange name recorded in the fixture set set
// (couchtest.FixtureSets), byte for byte.
func fixtureBody(t *testing.T, set, name string) []byte {
	t.Helper()
	return couchtest.FixtureFrom(t, set, name).Body
}

// fakeServer records requests and answers them with handlers in order; requests past the last
// handler hang (headers sent) until the client goes away.
type fakeServer struct {
	*httptest.Server
	mu       sync.Mutex
	reqs     []*url.URL
	handlers []http.HandlerFunc
}

func newFakeServer(t *testing.T, handlers ...http.HandlerFunc) *fakeServer {
	t.Helper()
	f := &fakeServer{handlers: handlers}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		n := len(f.reqs)
		f.reqs = append(f.reqs, r.URL)
		f.mu.Unlock()
		if n < len(f.handlers) {
			f.handlers[n](w, r)
			return
		}
		hang(w, r)
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeServer) requests() []*url.URL {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*url.URL(nil), f.reqs...)
}

func (f *fakeServer) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.reqs)
}

// hang sends 200 headers and holds the connection until the client leaves.
func hang(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
	<-r.Context().Done()
}

// serveBody answers with body (a fixture's) and ends the response.
func serveBody(status int, body []byte) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}
}

// serveLinesThenHang writes lines (each ended by "\n"), flushes, then holds the connection.
func serveLinesThenHang(lines ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		for _, l := range lines {
			_, _ = w.Write([]byte(l + "\n"))
		}
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}
}

func lines(body []byte) []string {
	var out []string
	for _, l := range strings.Split(string(body), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}
