package couch

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// BenchmarkSweepImpact measures what a reconciliation sweep's snapshot of N dbs does to the
// server's _db_updates feed, which every job of the pipeline waits for: a writer puts one doc a
// tenth of a second into a random one of the N dbs and times the first _db_updates row naming
// the db after the write was sent, while the server is left alone (quiet, 20 s), while one
// snapshot reads the N dbs' infos at once (TakeSnapshot, the sweep before), and while one reads
// them spread (TakeSnapshotSpread over a tenth of the default sweep interval, the sweep now), in
// turn, each snapshot's phase lasting until 10 s after it ended.
// Reported: the rows' p50/p99/max per phase, each phase's p99 and max as ratios to the quiet
// phase's, and how long each snapshot took. Apache CouchDB 3 only (PouchDB Server has no
// _db_updates). Tunables: BENCH_SWEEP_DBS (N, 2000), BENCH_SWEEP_SPREAD (60s). Run: go test
// -run x -bench SweepImpact -benchtime 1x ./pkg/couch (with COUCHDB_URL).
func BenchmarkSweepImpact(b *testing.B) {
	srv := couchtest.Get(b)
	if srv.PouchDB {
		b.Skip("PouchDB Server has no _db_updates of its own")
	}
	n := envInt(b, "BENCH_SWEEP_DBS", 2000)
	spread := time.Minute
	if v := os.Getenv("BENCH_SWEEP_SPREAD"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			b.Fatalf("BENCH_SWEEP_SPREAD=%q: %v", v, err)
		}
		spread = d
	}
	c, err := New(Config{URL: srv.URL, RequestTimeout: DefaultRequestTimeout}, nil)
	if err != nil {
		b.Fatal(err)
	}
	prefix := couchtest.UniqueName(b, "sweepimpact") + "_"
	dbs := make([]string, n)
	for i := range dbs {
		dbs[i] = fmt.Sprintf("%s%05d", prefix, i)
	}
	createDBs(b, srv, dbs)
	match := func(db string) bool { return strings.HasPrefix(db, prefix) }

	ctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	rows := followUpdates(ctx, b, c, match)

	for b.Loop() {
		rng := rand.New(rand.NewPCG(1, 2))
		// phase writes one doc every 100 ms while during runs, and returns each write's wait
		// for its row (ms).
		phase := func(name string, during func() error) []float64 {
			var writes []benchWrite
			done := make(chan error, 1)
			go func() { done <- during() }()
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case err := <-done:
					if err != nil {
						b.Fatalf("%s: %v", name, err)
					}
					return rows.waits(b, writes)
				case <-tick.C:
				}
				db := dbs[rng.IntN(len(dbs))]
				sent := time.Now()
				srv.Put(b, db, fmt.Sprintf("%s%d", name, i), map[string]any{"i": i})
				writes = append(writes, benchWrite{db, sent, time.Now()})
			}
		}
		var atOnceTook, spreadTook time.Duration
		const after = 10 * time.Second // a snapshot's phase goes on for this long after it
		quiet := phase("quiet", func() error { return backoff.Sleep(ctx, 20*time.Second) })
		atOnce := phase("atonce", func() error {
			start := time.Now()
			snap, err := c.TakeSnapshot(ctx, match)
			atOnceTook = time.Since(start)
			return errors.Join(checkSnapshot(snap, err, n), backoff.Sleep(ctx, after))
		})
		spreadW := phase("spread", func() error {
			start := time.Now()
			snap, err := c.TakeSnapshotSpread(ctx, match, spread)
			spreadTook = time.Since(start)
			return errors.Join(checkSnapshot(snap, err, n), backoff.Sleep(ctx, after))
		})
		for _, p := range []struct {
			name string
			ms   []float64
		}{{"quiet", quiet}, {"atonce", atOnce}, {"spread", spreadW}} {
			b.ReportMetric(benchdata.Percentile(p.ms, 0.5), p.name+"_p50_ms")
			b.ReportMetric(benchdata.Percentile(p.ms, 0.99), p.name+"_p99_ms")
			b.ReportMetric(benchdata.Percentile(p.ms, 1), p.name+"_max_ms")
			b.ReportMetric(float64(len(p.ms)), p.name+"_writes")
			if p.name != "quiet" {
				b.ReportMetric(benchdata.Percentile(p.ms, 0.99)/benchdata.Percentile(quiet, 0.99), p.name+"_p99_ratio")
				b.ReportMetric(benchdata.Percentile(p.ms, 1)/benchdata.Percentile(quiet, 1), p.name+"_max_ratio")
			}
		}
		b.ReportMetric(atOnceTook.Seconds(), "atonce_snapshot_s")
		b.ReportMetric(spreadTook.Seconds(), "spread_snapshot_s")
	}
}

func checkSnapshot(snap Snapshot, err error, n int) error {
	if err == nil && len(snap) != n {
		err = fmt.Errorf("snapshot has %d of the %d dbs", len(snap), n)
	}
	return err
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

// createDBs creates dbs, eight at a time, each with one doc; they are deleted when b ends.
func createDBs(b *testing.B, srv *couchtest.Server, dbs []string) {
	todo := make(chan string)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for db := range todo {
				srv.CreateDB(b, db)
				srv.Put(b, db, "doc", map[string]any{"db": db})
			}
		})
	}
	for _, db := range dbs {
		todo <- db
	}
	close(todo)
	wg.Wait()
}

// updateRows records when the _db_updates feed named each db.
type updateRows struct {
	mu   sync.Mutex
	seen map[string][]time.Time
}

// followUpdates follows the server's _db_updates feed from now, for the dbs match accepts.
func followUpdates(ctx context.Context, b *testing.B, c *Client, match func(string) bool) *updateRows {
	feed, err := c.NewUpdatesFeed(ctx, SourceDBUpdates, FeedOptions{Match: match})
	if err != nil {
		b.Fatal(err)
	}
	u := &updateRows{seen: map[string][]time.Time{}}
	go func() {
		_ = feed.Run(ctx, SinceNow, func(ev DBEvent) error {
			u.mu.Lock()
			u.seen[ev.DB] = append(u.seen[ev.DB], time.Now())
			u.mu.Unlock()
			return nil
		})
	}()
	return u
}

// benchWrite is one doc the writer put: its db, when it was sent and when it was answered.
type benchWrite struct {
	db        string
	sent, ack time.Time
}

// waits returns, for each write, the time from its answer to the first row naming its db at
// or after it was sent, waiting up to 10 s for rows still due; a write without a row fails b.
func (u *updateRows) waits(b *testing.B, writes []benchWrite) []float64 {
	var out []float64
	deadline := time.Now().Add(10 * time.Second)
	for _, w := range writes {
		db, sent, ack := w.db, w.sent, w.ack
		for {
			u.mu.Lock()
			i := slices.IndexFunc(u.seen[db], func(t time.Time) bool { return !t.Before(sent) })
			var at time.Time
			if i >= 0 {
				at = u.seen[db][i]
			}
			u.mu.Unlock()
			if i >= 0 {
				out = append(out, float64(max(0, at.Sub(ack)).Microseconds())/1000)
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("no _db_updates row for %s within 10 s", db)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return out
}
