package replicate

import (
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// TestOpenRevsFallback: a source server without _bulk_get (a proxy answers 405, as CouchDB 1.x
// would) is read with GET ?open_revs=; conflicts, deletions and attachments still replicate.
func TestOpenRevsFallback(t *testing.T) {
	s := couchtest.Get(t)
	up, err := url.Parse(s.URL)
	require.NoError(t, err)
	var bulkGets, openRevs atomic.Int64
	// Each _bulk_get is answered once another one arrives or after a second: batches are
	// fetched in parallel, and a run whose batches each tried _bulk_get before the first
	// answer came would send a second one within that time.
	var mu sync.Mutex
	arrived := make(chan struct{}) // closed by the next _bulk_get to arrive
	proxy := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: up.Scheme, Host: up.Host, Path: up.Path})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.HasSuffix(r.URL.Path, "/_bulk_get"):
			bulkGets.Add(1)
			mu.Lock()
			close(arrived)
			next := make(chan struct{})
			arrived = next
			mu.Unlock()
			select {
			case <-next:
			case <-time.After(time.Second):
			case <-r.Context().Done():
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusMethodNotAllowed)
			_, _ = w.Write([]byte(`{"error":"method_not_allowed","reason":"Only GET,HEAD,PUT,DELETE allowed"}`))
			return
		case r.URL.Query().Has("open_revs"):
			openRevs.Add(1)
		}
		proxy.ServeHTTP(w, r)
	}))
	defer srv.Close()

	source, target := s.NewDB(t, "osrc_"), s.NewDB(t, "otgt_")
	m := &mutator{t: t, s: s, db: source, rng: rand.New(rand.NewPCG(7, 7))}
	viaProxy := *up
	viaProxy.Host = strings.TrimPrefix(srv.URL, "http://")
	opt := Options{Source: viaProxy.String() + "/" + url.PathEscape(source), Target: dbURL(s, target), BatchSize: 10}
	for round := range 2 {
		for range 40 {
			m.step()
		}
		res, err := Run(t.Context(), opt, testLog(t))
		require.NoError(t, err, "round %d", round)
		assert.Zero(t, res.DocWriteFailures)
		requireSameLeaves(t, s, source, target)
	}
	assert.EqualValues(t, 2, bulkGets.Load(), "_bulk_get is tried once per run")
	assert.Positive(t, openRevs.Load())
}
