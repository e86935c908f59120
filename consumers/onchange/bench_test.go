package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// cpuClock reads the CPU time of this process (consumer, embedded NATS, sink and loops) and,
// when BENCH_SERVER_PID names it, of the CouchDB server's process.
type cpuClock struct{ serverPID int }

func newCPUClock(b *testing.B) cpuClock {
	var c cpuClock
	if v := os.Getenv("BENCH_SERVER_PID"); v != "" {
		pid, err := strconv.Atoi(v)
		require.NoError(b, err, "BENCH_SERVER_PID=%q: want the pid of the CouchDB server's process", v)
		c.serverPID = pid
	}
	return c
}

// cpuTimes is what a cpuClock read.
type cpuTimes struct{ self, server time.Duration }

func (c cpuClock) now(b *testing.B) cpuTimes {
	var ru syscall.Rusage
	require.NoError(b, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	t := cpuTimes{self: time.Duration(ru.Utime.Nano() + ru.Stime.Nano())}
	if c.serverPID > 0 {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.serverPID))
		require.NoError(b, err, "read the CouchDB server's CPU time")
		// utime and stime are fields 14 and 15, after the parenthesised command name.
		f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		utime, err1 := strconv.ParseInt(f[11], 10, 64)
		stime, err2 := strconv.ParseInt(f[12], 10, 64)
		require.NoError(b, errors.Join(err1, err2), "parse /proc/%d/stat", c.serverPID)
		t.server = time.Duration(utime+stime) * 10 * time.Millisecond // USER_HZ is 100 on Linux
	}
	return t
}

// settle collects this process's garbage and, when the clock reads the CouchDB server's CPU,
// waits (at most settleLimit) until the server has used at most one clock tick in
// settleWindow: a timed run then starts on a machine that is done with what came before it.
func (c cpuClock) settle(b *testing.B) {
	runtime.GC()
	if c.serverPID == 0 {
		return
	}
	const settleWindow, settleLimit = 100 * time.Millisecond, 3 * time.Second
	deadline := time.Now().Add(settleLimit)
	last := c.now(b).server
	for time.Now().Before(deadline) {
		time.Sleep(settleWindow) // sampling the server's CPU over a window, not waiting on a condition
		cur := c.now(b).server
		if cur-last <= 10*time.Millisecond {
			return
		}
		last = cur
	}
}

func (t cpuTimes) sub(u cpuTimes) cpuTimes { return cpuTimes{t.self - u.self, t.server - u.server} }
func (t cpuTimes) add(u cpuTimes) cpuTimes { return cpuTimes{t.self + u.self, t.server + u.server} }

// countingSink answers every request with 200 after delay and counts them.
func countingSink(b *testing.B, delay time.Duration) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if delay > 0 {
			time.Sleep(delay)
		}
		n.Add(1)
	}))
	b.Cleanup(s.Close)
	return s, &n
}

// bulkWrite writes n new docs into db.
func (e *env) bulkWrite(b *testing.B, db string, n int) {
	docs := make([]map[string]any, n)
	for i := range docs {
		docs[i] = map[string]any{"n": i, "text": "some payload text"}
	}
	require.NoError(b, e.Couch.Do(b, "POST", "/"+couchtest.PathDB(db)+"/_bulk_docs", map[string]any{"docs": docs}, nil))
}

// baseline is the minimal hand-written loop: read db's changes after since and POST each one.
func baseline(ctx context.Context, cc *couch.Client, hc *http.Client, db, since, url string) (string, int, error) {
	page, err := cc.Changes(ctx, db, couch.ChangesOptions{Since: since, IncludeDocs: true})
	if err != nil {
		return since, 0, err
	}
	for _, c := range page.Results {
		body, _ := json.Marshal(map[string]any{"change": map[string]any{"id": c.ID, "seq": c.Seq, "doc": c.Doc}})
		resp, err := hc.Post(url, "application/json", bytes.NewReader(body))
		if err != nil {
			return since, 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return page.LastSeq, len(page.Results), nil
}

// concurrentLoop runs one(db, since) for every db from workers goroutines at once, each db
// from its seq in since, which it moves on; it returns the changes handled.
func concurrentLoop(b *testing.B, workers int, dbs []string, since map[string]string, one func(db, since string) (string, int, error)) int {
	var mu sync.Mutex
	var total int
	todo := make(chan string, len(dbs))
	for _, db := range dbs {
		todo <- db
	}
	close(todo)
	var wg sync.WaitGroup
	for range min(workers, len(dbs)) {
		wg.Go(func() {
			for db := range todo {
				mu.Lock()
				from := since[db]
				mu.Unlock()
				next, n, err := one(db, from)
				if !assert.NoError(b, err, "loop over %s", db) {
					continue
				}
				mu.Lock()
				since[db], total = next, total+n
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return total
}

// BenchmarkDispatch measures the pipeline's changes/s (enqueue to last webhook answer) to a
// local sink answering in 0 and 50 ms, block true and false, over 1 and 100 dbs, next to two
// hand-written loops run on the same server in the same run:
//
//   - baseline_changes/s (ratio = pipeline / it): one sequential `_changes`→POST loop over the
//     changes of a single db, as many as the pipeline's (at most 1,000; 20 for the slow sink).
//     It reads one feed for all its changes, so against it the pipeline over 100 dbs pays
//     CouchDB's fixed cost of 99 more `_changes` requests.
//   - loop_changes/s (ratio_loop = pipeline / it): the same loop over the same shape of work
//     (as many dbs, as many changes each, dbs the rule does not match), run by as many
//     goroutines as the consumer runs jobs (SPIEGEL_CONCURRENCY, 20 here) — the fastest a
//     hand-written program does this work on this server, without checkpoints, leases,
//     retries or a queue. ratio_loop is the pipeline's own cost.
//
// Where the time goes on a machine the work saturates: cpu_us/change is this process's CPU per
// change (the consumer with the embedded NATS and the sink in the pipeline's run, the loop and
// the sink in the loops'), for the pipeline, the one-db loop (base_) and the same-shape loop
// (loop_); with BENCH_SERVER_PID, couchdb_cpu_us/change is the server's.
//
// With 100 dbs and a 50 ms sink the ratios show the scaling with SPIEGEL_CONCURRENCY: the
// one-db baseline is one sequential loop. A first, untimed pass creates each db's checkpoint
// (a _local read and write per db, once in a rule's life, which the loops never pay);
// first_pass_changes/s is the pipeline's rate in it, the other figures are the steady state's.
// The three runs of a pass take turns at going first after the pass's writes, and each starts
// once CouchDB and this process are quiet (cpuClock.settle). Run with -benchtime=6x (a multiple
// of three: each run goes first, second and third equally often).
func BenchmarkDispatch(b *testing.B) {
	e := newEnv(b, 60*time.Second)
	e.cfg.Concurrency = 20
	app := e.start(b)
	cases := []struct {
		delay time.Duration
		block bool
		dbs   int
		perDB int
	}{
		{0, true, 1, 1000}, {0, false, 1, 1000},
		{50 * time.Millisecond, true, 1, 20}, {50 * time.Millisecond, false, 1, 100},
		{0, true, 100, 20}, {0, false, 100, 20},
		{50 * time.Millisecond, true, 100, 3}, {50 * time.Millisecond, false, 100, 5},
	}
	for i, c := range cases {
		name := fmt.Sprintf("sink=%s/block=%v/dbs=%d", c.delay, c.block, c.dbs)
		sink, count := countingSink(b, c.delay)
		prefix := fmt.Sprintf("%sb%d_", e.Prefix, i)
		dbs := make([]string, c.dbs)
		for k := range dbs {
			dbs[k] = fmt.Sprintf("%s%03d", prefix, k)
			e.Couch.CreateDB(b, dbs[k])
		}
		baseDB := "x" + prefix + "base" // not matched by the rule
		e.Couch.CreateDB(b, baseDB)
		loopDBs := make([]string, c.dbs) // the concurrent loop's, not matched by the rule either
		loopSince := map[string]string{}
		for k := range loopDBs {
			loopDBs[k] = fmt.Sprintf("x%sloop%03d", prefix, k)
			e.Couch.CreateDB(b, loopDBs[k])
		}
		rev := e.putRule(b, fmt.Sprintf("bench%d", i), map[string]any{"db_name": "^" + regexp.QuoteMeta(prefix), "url": sink.URL + "/hook",
			"method": "POST", "block": c.block, "params": map[string]any{"change": "$change"}})
		waitRule(b, fmt.Sprintf("bench%d", i), rev, app)
		since := ""
		b.Run(name, func(b *testing.B) {
			hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			var pipeDur, baseDur, loopDur time.Duration
			var pipeN, baseN, loopN int
			clock := newCPUClock(b)
			var pipeCPU, baseCPU, loopCPU, pc, bc, lc cpuTimes
			// pass writes the changes of one round, then runs the pipeline and the two loops over
			// them, each timed alone, in an order that turns with k: the run right after the writes
			// would otherwise always be the same one (it shares the machine with what CouchDB and
			// this process's collector still do about them). Each run starts once both are quiet
			// (settle).
			pass := func(k int) (pipeD time.Duration, pipeC int, baseD time.Duration, baseC int, loopD time.Duration, loopC int) {
				b.StopTimer()
				for _, db := range dbs {
					e.bulkWrite(b, db, c.perDB)
				}
				total := c.dbs * c.perDB
				baseTotal := min(total, 1000) // the baseline's rate needs fewer changes: keep slow sinks quick
				if c.delay > 0 {
					baseTotal = min(total, 20)
				}
				e.bulkWrite(b, baseDB, baseTotal)
				for _, db := range loopDBs {
					e.bulkWrite(b, db, c.perDB)
				}
				runs := []func(){
					func() {
						want := count.Load() + int64(total)
						clock.settle(b)
						b.StartTimer()
						start, cpu0 := time.Now(), clock.now(b)
						for _, db := range dbs {
							e.enqueue(b, db)
						}
						for count.Load() < want {
							time.Sleep(time.Millisecond)
						}
						pipeD, pipeC = time.Since(start), total
						b.StopTimer()
						pc = clock.now(b).sub(cpu0)
					},
					func() {
						clock.settle(b)
						start, cpu0 := time.Now(), clock.now(b)
						var err error
						since, baseC, err = baseline(b.Context(), app.Couch, hc, baseDB, since, sink.URL+"/base")
						count.Add(-int64(baseC))
						require.NoError(b, err)
						baseD = time.Since(start)
						bc = clock.now(b).sub(cpu0)
					},
					func() {
						clock.settle(b)
						start, cpu0 := time.Now(), clock.now(b)
						loopC = concurrentLoop(b, e.cfg.Concurrency, loopDBs, loopSince, func(db, since string) (string, int, error) {
							return baseline(b.Context(), app.Couch, hc, db, since, sink.URL+"/loop")
						})
						count.Add(-int64(loopC))
						loopD = time.Since(start)
						lc = clock.now(b).sub(cpu0)
					},
				}
				for i := range runs {
					runs[(k+i)%len(runs)]()
				}
				return
			}
			// The first pass creates each db's checkpoint (a _local read and write per db, once in
			// a rule's life): its rate is reported on its own, the ratios are the steady state's.
			firstD, firstN, _, _, _, _ := pass(0)
			b.ResetTimer()
			for k := range b.N {
				pd, pn, bd, bn, ld, ln := pass(k)
				pipeDur, pipeN, baseDur, baseN, loopDur, loopN = pipeDur+pd, pipeN+pn, baseDur+bd, baseN+bn, loopDur+ld, loopN+ln
				pipeCPU, baseCPU, loopCPU = pipeCPU.add(pc), baseCPU.add(bc), loopCPU.add(lc)
			}
			b.ReportMetric(float64(firstN)/firstD.Seconds(), "first_pass_changes/s")
			pipe, base, loop := float64(pipeN)/pipeDur.Seconds(), float64(baseN)/baseDur.Seconds(), float64(loopN)/loopDur.Seconds()
			b.ReportMetric(pipe, "changes/s")
			b.ReportMetric(base, "baseline_changes/s")
			b.ReportMetric(pipe/base, "ratio")
			b.ReportMetric(loop, "loop_changes/s")
			b.ReportMetric(pipe/loop, "ratio_loop")
			perChange := func(d time.Duration, n int) float64 { return float64(d.Microseconds()) / float64(n) }
			for _, r := range []struct {
				prefix string
				cpu    cpuTimes
				n      int
			}{{"", pipeCPU, pipeN}, {"base_", baseCPU, baseN}, {"loop_", loopCPU, loopN}} {
				b.ReportMetric(perChange(r.cpu.self, r.n), r.prefix+"cpu_us/change")
				if clock.serverPID > 0 {
					b.ReportMetric(perChange(r.cpu.server, r.n), r.prefix+"couchdb_cpu_us/change")
				}
			}
		})
	}
}
