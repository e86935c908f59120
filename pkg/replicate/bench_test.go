package replicate

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// benchDocs is the number of docs of the bulk benchmark (REPLICATE_BENCH_DOCS overrides 20000).
func benchDocs() int {
	if n, err := strconv.Atoi(os.Getenv("REPLICATE_BENCH_DOCS")); err == nil && n > 0 {
		return n
	}
	return 20000
}

// serverReplicate runs the server's own one-shot POST /_replicate from source to target (full
// URLs, as CouchDB 3 requires) and returns its wall time.
func serverReplicate(b *testing.B, s *couchtest.Server, source, target string) time.Duration {
	b.Helper()
	body, err := json.Marshal(map[string]any{"source": dbURL(s, source), "target": dbURL(s, target)})
	require.NoError(b, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/_replicate", bytes.NewReader(body))
	require.NoError(b, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	start := time.Now()
	resp, err := s.HTTP.Do(req)
	require.NoError(b, err)
	ans, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	d := time.Since(start)
	require.Less(b, resp.StatusCode, 300, string(ans))
	return d
}

// BenchmarkNativeVsServer compares Run with the server's own POST /_replicate on the same
// server in the same run: "bulk" replicates benchDocs() small docs into an empty target
// (docs/s for both, and native/server); "incremental" replicates a db that received 1–3 docs
// since its last replication (wall time per run for both, HTTP requests per native run).
// Run it with -benchtime=1x (bulk) or a few x (incremental).
func BenchmarkNativeVsServer(b *testing.B) {
	s := couchtest.Get(b)
	hc := &http.Client{Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 32}}
	b.Run("bulk", func(b *testing.B) {
		n := benchDocs()
		benchFull(b, s, hc, n, fmt.Sprintf("%d docs", n), func(db string) { createDocs(b, s, db, "b", n) })
	})
	b.Run("attachments", func(b *testing.B) {
		n := max(benchDocs()/10, 1)
		benchFull(b, s, hc, n, fmt.Sprintf("%d docs with a 10 KB attachment", n),
			func(db string) { createDocsWithAttachment(b, s, db, n, 10<<10) })
	})
	b.Run("incremental", func(b *testing.B) {
		source, nt, st := s.NewDB(b, "isrc_"), s.NewDB(b, "inat_"), s.NewDB(b, "isrv_")
		createDocs(b, s, source, "base", 1000)
		opt := Options{Source: dbURL(s, source), Target: dbURL(s, nt), HTTPClient: hc}
		_, err := Run(context.Background(), opt, nil)
		require.NoError(b, err)
		serverReplicate(b, s, source, st)
		var server time.Duration
		native, requests := incrementalRuns(b, s, source, opt, func(time.Time) { server += serverReplicate(b, s, source, st) })
		b.ReportMetric(float64(native.Microseconds())/1000/float64(b.N), "native_ms/run")
		b.ReportMetric(float64(server.Microseconds())/1000/float64(b.N), "server_ms/run")
		b.ReportMetric(float64(requests)/float64(b.N), "native_requests/run")
		b.Logf("incremental (%d runs): native %.1f ms/run, %.1f requests/run; server _replicate %.1f ms/run",
			b.N, float64(native.Microseconds())/1000/float64(b.N), float64(requests)/float64(b.N),
			float64(server.Microseconds())/1000/float64(b.N))
	})
	b.Run("incremental-cached", func(b *testing.B) {
		// As the replicator consumer runs: checkpoints cached and deferred. to_target is the time
		// from the run's start to the answer of its last _bulk_docs (the docs on the target).
		source, target := s.NewDB(b, "icsrc_"), s.NewDB(b, "ictgt_")
		createDocs(b, s, source, "base", 1000)
		var lastWrite atomic.Int64 // unix ns of the last _bulk_docs answer
		tr := roundTripFunc(func(req *http.Request) (*http.Response, error) {
			resp, err := hc.Transport.RoundTrip(req)
			if err == nil && strings.HasSuffix(req.URL.Path, "/_bulk_docs") {
				lastWrite.Store(time.Now().UnixNano())
			}
			return resp, err
		})
		opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), HTTPClient: &http.Client{Transport: tr},
			Checkpoints: NewCheckpointCache(time.Hour, 10), CheckpointDefer: 5 * time.Minute, CheckpointDeferChanges: 100}
		_, err := Run(context.Background(), opt, nil)
		require.NoError(b, err)
		var toTarget time.Duration
		wall, requests := incrementalRuns(b, s, source, opt, func(start time.Time) { toTarget += time.Unix(0, lastWrite.Load()).Sub(start) })
		b.ReportMetric(float64(wall.Microseconds())/1000/float64(b.N), "native_ms/run")
		b.ReportMetric(float64(toTarget.Microseconds())/1000/float64(b.N), "to_target_ms/run")
		b.ReportMetric(float64(requests)/float64(b.N), "native_requests/run")
	})
}

// incrementalRuns runs opt b.N times, each after 1–3 new docs in source, and returns the runs'
// wall time and requests; after is called with each run's start once it ended.
func incrementalRuns(b *testing.B, s *couchtest.Server, source string, opt Options, after func(start time.Time)) (wall time.Duration, requests int64) {
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		for j := range 1 + i%3 {
			s.Put(b, source, fmt.Sprintf("inc-%d-%d", i, j), map[string]any{"i": i})
		}
		b.StartTimer()
		start := time.Now()
		res, err := Run(context.Background(), opt, nil)
		wall += time.Since(start)
		require.NoError(b, err)
		require.EqualValues(b, 1+i%3, res.DocsWritten)
		requests += res.Requests
		after(start)
	}
	return wall, requests
}

// createDocsWithAttachment writes n docs to db, each with one attachment of size bytes
// (random, so that nothing compresses it away), in batches of 200.
func createDocsWithAttachment(b *testing.B, s *couchtest.Server, db string, n, size int) {
	b.Helper()
	data := make([]byte, size)
	for start := 0; start < n; start += 200 {
		docs := make([]map[string]any, 0, 200)
		for i := start; i < min(start+200, n); i++ {
			_, _ = rand.Read(data)
			docs = append(docs, map[string]any{
				"_id": fmt.Sprintf("att%06d", i), "n": i,
				"_attachments": map[string]any{"blob.bin": map[string]any{
					"content_type": "application/octet-stream", "data": base64.StdEncoding.EncodeToString(data),
				}},
			})
		}
		require.NoError(b, s.Do(b, http.MethodPost, "/"+db+"/_bulk_docs", map[string]any{"docs": docs}, nil))
	}
}

// benchFull replicates a source of n docs (written by fill) into an empty target, natively and
// with the server's _replicate, b.N times, and reports docs/s of both and their ratio.
func benchFull(b *testing.B, s *couchtest.Server, hc *http.Client, n int, what string, fill func(db string)) {
	var native, server time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		source := s.NewDB(b, "fsrc_")
		fill(source)
		nt, st := s.NewDB(b, "fnat_"), s.NewDB(b, "fsrv_")
		b.StartTimer()
		start := time.Now()
		res, err := Run(context.Background(), Options{Source: dbURL(s, source), Target: dbURL(s, nt), HTTPClient: hc}, nil)
		native += time.Since(start)
		require.NoError(b, err)
		require.EqualValues(b, n, res.DocsWritten)
		server += serverReplicate(b, s, source, st)
		b.StopTimer()
		require.Equal(b, n, docCount(b, s, st))
		b.StartTimer()
	}
	nd := float64(n*b.N) / native.Seconds()
	sd := float64(n*b.N) / server.Seconds()
	b.ReportMetric(nd, "native_docs/s")
	b.ReportMetric(sd, "server_docs/s")
	b.ReportMetric(nd/sd, "native/server")
	b.Logf("%s: native %.0f docs/s, server _replicate %.0f docs/s, ratio %.2f", what, nd, sd, nd/sd)
}
