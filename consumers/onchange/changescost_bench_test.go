package main

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// BenchmarkChangesCost splits what one on_change job costs the server into the part every
// `_changes` request pays whatever it returns and the part each change adds, so that
// BenchmarkDispatch's ratio against the one-db loop can be read: over 100 dbs of 20 changes a
// job pays the fixed part once per 20 changes, the one-db loop once per 1,000.
//
// Docs of the shape BenchmarkDispatch writes, read as the handler reads them (include_docs, to
// the feed's end), by 20 goroutines at once as the consumer's 20 job slots read (one at
// a time would leave the server's schedulers spinning between requests, counted as its CPU):
//   - fixed: a db of 1,000 docs read from its feed's end (no row), 500 times;
//   - page20: a db of 20 docs read from the start (a BenchmarkDispatch job), as many times;
//   - page1000: the db of 1,000 read from the start, a fifth as many times.
//
// Reported per request for each: server_us (the server's CPU, with BENCH_SERVER_PID) and wall_us;
// per_change_us, the server's CPU per change beyond the fixed part (from page1000); fixed_share20,
// the fixed part's share of a 20-change page; and ceiling100x20, the most the same work spread
// over 100 dbs of 20 changes can reach against one db of 2,000 when the server's CPU is all
// that counts: (fixed/1000 + per change) / (fixed/20 + per change). Without BENCH_SERVER_PID the
// derived figures use wall time. Run: go test -run x -bench ChangesCost -benchtime 1x
// ./consumers/onchange (with COUCHDB_URL and BENCH_SERVER_PID).
func BenchmarkChangesCost(b *testing.B) {
	srv := couchtest.Get(b)
	c, err := couch.New(couch.Config{URL: srv.URL, RequestTimeout: couch.DefaultRequestTimeout}, nil)
	require.NoError(b, err)
	// write creates a db of n docs and returns it with its feed's end.
	write := func(name string, n int) (string, string) {
		db := couchtest.UniqueName(b, name)
		srv.CreateDB(b, db)
		docs := make([]map[string]any, n)
		for i := range docs {
			docs[i] = map[string]any{"n": i, "text": "some payload text"}
		}
		require.NoError(b, srv.Do(b, "POST", "/"+couchtest.PathDB(db)+"/_bulk_docs", map[string]any{"docs": docs}, nil))
		end, err := c.Changes(b.Context(), db, couch.ChangesOptions{Since: "now", Limit: 1})
		require.NoError(b, err)
		return db, end.LastSeq
	}
	db20, _ := write("changescost20", 20)
	db1000, end1000 := write("changescost1000", 1000)
	const n, workers = 500, 20
	clock := newCPUClock(b)

	// read runs times the read of db's changes from since (want of them), workers at a time, and
	// returns the server's CPU and the wall time per request.
	read := func(db, since string, want, times int) (server, wall float64) {
		todo := make(chan struct{}, times)
		for range times {
			todo <- struct{}{}
		}
		close(todo)
		start, t0 := clock.now(b), time.Now()
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for range todo {
					page, err := c.Changes(b.Context(), db, couch.ChangesOptions{Since: since, IncludeDocs: true})
					if assert.NoError(b, err) {
						assert.Len(b, page.Results, want)
					}
				}
			})
		}
		wg.Wait()
		used := clock.now(b).sub(start)
		return float64(used.server.Microseconds()) / float64(times), float64(time.Since(t0).Microseconds()) / float64(times)
	}
	b.ResetTimer()
	for b.Loop() {
		read(db1000, end1000, 0, 20) // warm: the shards open, the connections up
		read(db20, "", 20, 20)
		fixedS, fixedW := read(db1000, end1000, 0, n)
		p20S, p20W := read(db20, "", 20, n)
		p1000S, p1000W := read(db1000, "", 1000, n/5)
		b.ReportMetric(fixedW, "fixed_wall_us")
		b.ReportMetric(p20W, "page20_wall_us")
		b.ReportMetric(p1000W, "page1000_wall_us")
		fixed, page1000 := fixedW, p1000W
		if clock.serverPID != 0 {
			b.ReportMetric(fixedS, "fixed_server_us")
			b.ReportMetric(p20S, "page20_server_us")
			b.ReportMetric(p1000S, "page1000_server_us")
			fixed, page1000 = fixedS, p1000S
		}
		perChange := (page1000 - fixed) / 1000
		b.ReportMetric(perChange, "per_change_us")
		b.ReportMetric(fixed/(fixed+20*perChange), "fixed_share20")
		b.ReportMetric((fixed/1000+perChange)/(fixed/20+perChange), "ceiling100x20")
	}
}
