package e2e

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-kivik/kivik/v4"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// BenchmarkWorkload runs the workload operators care about through the real binaries and
// reports what a written doc costs: N user dbs of 10 docs each, 10 % of them active, one writer
// at RATE docs/s for DURATION into random active dbs, one pattern replicator rule fanning every
// user db into one target db and one on_change rule calling a local webhook for every change.
//
// Each process talks to CouchDB through its own counting proxy, so the report gives CouchDB
// requests per written doc by process and endpoint, writes to the spiegel db, connections, and
// what the pipeline asks of CouchDB while idle afterwards. Latencies run from the write's answer
// to the doc's arrival on the target's feed (replication) or at the webhook.
//
// Setups, all measured in the same run (BENCH_SETUPS picks some, comma-separated, run in that
// order):
//   - hot: the defaults (native engine, hot feeds);
//   - nohot: native engine, SPIEGEL_HOT_FEEDS=0 (the _db_updates path alone);
//   - direct: the defaults with no counting proxies, as in production: the processes talk to
//     CouchDB itself, and the proxies' CPU and round trips are not in the figures. Requests and
//     connections are not counted;
//   - capped: the defaults with each process's CouchDB connections for requests capped at 8;
//   - couchdb: the couchdb engine (POST /_replicate), SPIEGEL_HOT_FEEDS=0 — the earlier default;
//   - replicator: the server's own _replicator, one continuous job per user db (no on_change).
//     On PouchDB Server that is express-pouchdb's replicator daemon (pouchdb-replicator), which
//     runs a continuous PouchDB.replicate per doc inside the server. When the server is on this
//     machine, the jobs' source and target go through a counting proxy, so their requests and
//     connections are counted as the pipeline's are.
//
// On PouchDB Server the _db_updates feed is the test proxy's (couchtest.UpdatesProxy), which
// batches writes for 500 ms like CouchDB 3's default max_write_delay. Tunables: BENCH_DBS (100),
// BENCH_RATE (10), BENCH_DURATION (20s), BENCH_IDLE (15s), BENCH_SYNC_LIMIT (5m: how long the
// baseline may take for its initial sync before the writer starts anyway), BENCH_SERVER_PID (the
// server's process on this machine, sampled from /proc like the pipeline's), BENCH_BIN_DIR (the
// pipeline's binaries from another build, to compare; bin/ by default). BENCH_REPORT_DIR gets
// workload.md and, per setup, the run's record (scripts/e2e/benchdata) for the
// end-to-end report (make bench-e2e).
func BenchmarkWorkload(b *testing.B) {
	root := repoRoot(b, "producer", "replicator", "onchange")
	cs := couchtest.Get(b)
	w := workloadFromEnv(b)
	up := cs.NewUpdatesProxy(b, couchtest.CoalesceWindow(500*time.Millisecond))
	dir := os.Getenv("BENCH_REPORT_DIR")
	setups, err := workloadSetups()
	if err != nil {
		b.Fatal(err)
	}
	var results []workloadResult
	for range b.N {
		results = results[:0]
		for _, s := range setups {
			r := runWorkload(b, root, cs, up, w, s)
			b.Logf("%s: %s", s.key, r.summary())
			results = append(results, r)
			if dir != "" {
				// Each setup's figures are kept as soon as it ends: a run of several setups at
				// N = 10,000 takes over an hour, and one stopped later keeps the setups done.
				writeRun(b, dir, r.record(cs, w))
			}
		}
	}
	byKey := map[string]workloadResult{}
	for _, r := range results {
		byKey[r.setup.key] = r
	}
	if hot, ok := byKey["hot"]; ok {
		b.ReportMetric(ms(benchdata.Percentile(hot.repl, 0.99)), "repl-p99-ms")
		b.ReportMetric(ms(benchdata.Percentile(hot.hook, 0.99)), "hook-p99-ms")
		b.ReportMetric(hot.perDoc(hot.total()), "req/doc")
		b.ReportMetric(hot.perDoc(hot.spiegelWrites()), "spiegel-writes/doc")
		b.ReportMetric(hot.idleRate(), "idle-req/s")
		b.ReportMetric(hot.perDoc(int(hot.hotFeedsOpened)), "hot-feeds/doc")
		for _, base := range []string{"nohot", "couchdb", "replicator"} {
			if r, ok := byKey[base]; ok && len(r.repl) > 0 {
				b.ReportMetric(ms(benchdata.Percentile(hot.repl, 0.99))/ms(benchdata.Percentile(r.repl, 0.99)), "repl-p99-vs-"+base)
			}
		}
	}
	if dir != "" {
		report := workloadReport(cs, w, results)
		if err := os.WriteFile(filepath.Join(dir, "workload.md"), []byte(report), 0o644); err != nil {
			b.Fatalf("write report: %v", err)
		}
	}
}

// writeRun writes one setup's figures into dir, for scripts/benchreport.
func writeRun(b *testing.B, dir string, run benchdata.Run) {
	b.Helper()
	if err := benchdata.WriteFile(filepath.Join(dir, benchdata.FileName(run.Setup, run.DBs)), run); err != nil {
		b.Fatal(err)
	}
}

type workload struct {
	dbs, docsPerDB, active int
	rate                   float64
	duration, idle         time.Duration
	syncLimit              time.Duration // for the baseline's initial sync
	serverPID              int           // the CouchDB server's process, when known and local
	q                      int           // shard ranges of each user db (0: the server's default)
}

func workloadFromEnv(b *testing.B) workload {
	w := workload{dbs: 100, docsPerDB: 10, rate: 10, duration: 20 * time.Second, idle: 15 * time.Second, syncLimit: 5 * time.Minute}
	if v := os.Getenv("BENCH_DBS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 10 {
			b.Fatalf("BENCH_DBS=%q: want a number of at least 10", v)
		}
		w.dbs = n
	}
	if v := os.Getenv("BENCH_RATE"); v != "" {
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || r <= 0 {
			b.Fatalf("BENCH_RATE=%q: want docs per second above 0", v)
		}
		w.rate = r
	}
	for name, d := range map[string]*time.Duration{"BENCH_DURATION": &w.duration, "BENCH_IDLE": &w.idle, "BENCH_SYNC_LIMIT": &w.syncLimit} {
		if v := os.Getenv(name); v != "" {
			x, err := time.ParseDuration(v)
			if err != nil || x <= 0 {
				b.Fatalf("%s=%q: want a duration such as 20s", name, v)
			}
			*d = x
		}
	}
	if v := os.Getenv("BENCH_SERVER_PID"); v != "" {
		pid, err := strconv.Atoi(v)
		if err != nil || pid <= 0 {
			b.Fatalf("BENCH_SERVER_PID=%q: want the pid of the CouchDB server's process", v)
		}
		w.serverPID = pid
	}
	if v := os.Getenv("BENCH_Q"); v != "" {
		q, err := strconv.Atoi(v)
		if err != nil || q < 1 {
			b.Fatalf("BENCH_Q=%q: want the number of shard ranges of each db, at least 1", v)
		}
		w.q = q
	}
	w.active = max(1, w.dbs/10)
	return w
}

// dbOptions are the options the user dbs are created with: q when BENCH_Q sets it (Apache
// CouchDB; PouchDB Server ignores it). The target keeps the server's default.
func (w workload) dbOptions() []kivik.Option {
	if w.q == 0 {
		return nil
	}
	return []kivik.Option{kivik.Param("q", w.q)}
}

type workloadSetup struct {
	key, name    string
	vars         []string // SPIEGEL_ variables of the three processes
	replicatorDB bool
	direct       bool // no counting proxies: requests and connections are not counted
}

// workloadSetups returns the setups BENCH_SETUPS names, in the order it names them (every setup,
// in the order below, when it is empty): the setup that runs first meets a server that has just
// loaded the dbs, so swapping two setups tells that apart from what the setups do. A name that is
// no setup is an error.
func workloadSetups() ([]workloadSetup, error) {
	all := []workloadSetup{
		{key: "hot", name: "native engine, hot feeds (defaults)"},
		{key: "nohot", name: "native engine, no hot feeds", vars: []string{"SPIEGEL_HOT_FEEDS=0"}},
		{key: "direct", name: "defaults, no counting proxies (requests and connections not counted)", direct: true},
		{key: "capped", name: "defaults, SPIEGEL_COUCHDB_MAX_CONNECTIONS=8", vars: []string{"SPIEGEL_COUCHDB_MAX_CONNECTIONS=8"}},
		{key: "uncapped", name: "defaults, no cap on connections (SPIEGEL_COUCHDB_MAX_CONNECTIONS=0)", vars: []string{"SPIEGEL_COUCHDB_MAX_CONNECTIONS=0"}},
		{key: "couchdb", name: "couchdb engine, no hot feeds (earlier default)",
			vars: []string{"SPIEGEL_HOT_FEEDS=0", "SPIEGEL_REPLICATION_ENGINE=couchdb"}},
		{key: "replicator", name: "the server's _replicator, one continuous job per db", replicatorDB: true},
	}
	pick := os.Getenv("BENCH_SETUPS")
	if pick == "" {
		return all, nil
	}
	var out []workloadSetup
	for _, k := range strings.Split(pick, ",") {
		i := slices.IndexFunc(all, func(s workloadSetup) bool { return s.key == k })
		switch {
		case i < 0:
			keys := make([]string, len(all))
			for j, s := range all {
				keys[j] = s.key
			}
			return nil, fmt.Errorf("BENCH_SETUPS=%q: %q is not a setup (%s)", pick, k, strings.Join(keys, ", "))
		case !slices.ContainsFunc(out, func(s workloadSetup) bool { return s.key == k }):
			out = append(out, all[i])
		}
	}
	return out, nil
}

// workloadResult is what one setup measured.
type workloadResult struct {
	setup       workloadSetup
	written     int
	initialSync time.Duration   // -1: not within the limit (the baseline only)
	synced      int             // docs on the target when the initial sync was judged
	repl, hook  []time.Duration // per written doc that arrived
	lostRepl    int             // written docs not on the target within the drain deadline
	lostHook    int
	// by process (producer, replicator, onchange), by endpoint
	requests, idle map[string]map[string]int
	idleFor        time.Duration
	maxConns       map[string]int
	idleConns      map[string]int

	// for the end-to-end report (record)
	started                time.Time
	loadStart, loadEnd     string
	writerStart, writerEnd time.Duration // since started
	idleStart, idleEnd     time.Duration
	writes                 []benchdata.Write
	samples                []benchdata.Sample
	unmeasured             string  // why requests and connections were not counted ("": they were)
	hotFeedsOpened         float64 // by the producer while the writer ran and until every doc arrived (-1: unknown)
}

func (r workloadResult) total() int {
	n := 0
	for _, eps := range r.requests {
		for _, c := range eps {
			n += c
		}
	}
	return n
}

func (r workloadResult) spiegelWrites() int {
	n := 0
	for _, eps := range r.requests {
		for ep, c := range eps {
			if strings.Contains(ep, "spiegel-db") && isWrite(ep) {
				n += c
			}
		}
	}
	return n
}

func (r workloadResult) perDoc(n int) float64 {
	if r.written == 0 {
		return 0
	}
	return float64(n) / float64(r.written)
}

// idleRate returns the requests per second the idle pipeline made.
func (r workloadResult) idleRate() float64 {
	n := 0
	for _, eps := range r.idle {
		for _, c := range eps {
			n += c
		}
	}
	if r.idleFor <= 0 {
		return 0
	}
	return float64(n) / r.idleFor.Seconds()
}

func (r workloadResult) summary() string {
	return fmt.Sprintf("written %d, replication p50/p99 %.0f/%.0f ms (lost %d), webhook p50/p99 %.0f/%.0f ms (lost %d), %.1f requests/doc, "+
		"connections max %v, open when idle %v, hot feeds opened per written doc %.3f",
		r.written, ms(benchdata.Percentile(r.repl, 0.5)), ms(benchdata.Percentile(r.repl, 0.99)), r.lostRepl,
		ms(benchdata.Percentile(r.hook, 0.5)), ms(benchdata.Percentile(r.hook, 0.99)), r.lostHook, r.perDoc(r.total()), r.maxConns, r.idleConns,
		r.perDoc(int(r.hotFeedsOpened)))
}

// runWorkload installs a fresh pipeline (or _replicator jobs), loads the dbs, waits for the
// initial sync, runs the writer, waits for delivery and then watches the idle pipeline.
func runWorkload(b *testing.B, root string, cs *couchtest.Server, up *couchtest.UpdatesProxy, w workload, s workloadSetup) workloadResult {
	b.Helper()
	res := workloadResult{setup: s, loadStart: loadAvg()}
	writer := up.Server()
	prefix := couchtest.UniqueName(b, "bench_"+s.key+"_") + "_"
	target := prefix + "target"
	users := make([]string, w.dbs)
	for i := range users {
		users[i] = fmt.Sprintf("%su%05d", prefix, i)
	}
	cs.CreateDB(b, target) // the server's default q: a big db that every replication writes to
	loadDBs(b, cs, writer, users, w.docsPerDB, w.dbOptions()...)
	initial := w.dbs * w.docsPerDB
	sink := newLatencySink(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var procs []*proc
	var proxies map[string]*countingProxy
	var js jetstream.JetStream
	started := time.Now()
	res.started = started
	if s.replicatorDB {
		proxies = startReplicatorJobs(b, cs, users, target)
		if len(proxies) == 0 {
			res.unmeasured = "The server is not on this machine, so its replications could not go through a counting proxy: " +
				"their requests and connections are not measured."
		}
	} else {
		var ns *natstest.Server
		procs, proxies, ns = startPipeline(b, root, cs, up, prefix, target, sink.URL, s.vars, s.direct)
		if s.direct {
			res.unmeasured = "The processes talked to CouchDB without counting proxies: their requests and connections are not measured."
		}
		_, js = ns.Connect(b)
	}
	sampleCtx, stopSampling := context.WithCancel(ctx)
	smp := startSampler(sampleCtx, started, time.Second, procs, proxies, js, w.serverPID)
	defer stopSampling()
	syncFrom := markCPU(procs, w.serverPID)
	profCtx, stopProfiles := context.WithCancel(ctx)
	defer stopProfiles()
	startSyncProfiles(profCtx, b, s.key, procs)

	var onTarget int
	b.Cleanup(func() {
		if b.Failed() {
			b.Logf("%s: %d of %d docs on the target, %d at the webhook", s.key, onTarget, initial, sink.distinct())
		}
	})
	synced := func() bool {
		onTarget = docCount(b, cs, target)
		return onTarget >= initial && (s.replicatorDB || sink.distinct() >= initial)
	}
	if s.replicatorDB {
		// The server's scheduler may not run every job at once (CouchDB's max_jobs): the initial
		// sync is then not complete within the limit, which the report says, and the writer
		// starts anyway.
		res.initialSync = -1
		for deadline := started.Add(w.syncLimit); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if synced() {
				res.initialSync = time.Since(started)
				break
			}
		}
		b.Logf("%s: initial sync %v, %d of %d docs on the target", s.key, res.initialSync, onTarget, initial)
	} else {
		costLogged := false
		b.Cleanup(func() { // a sync that did not end within the limit: what it cost until then
			if !costLogged {
				logSyncCost(b, s.key+" (not synced)", w.dbs, syncFrom, markCPU(procs, w.serverPID), snapshotAll(proxies, false), smp.snapshot(), sweepChecks(b, procs))
			}
		})
		waitFor(b, max(5*time.Minute, w.syncLimit), s.key+": initial sync", procs, synced)
		res.initialSync = time.Since(started)
		stopProfiles()
		logSyncCost(b, s.key, w.dbs, syncFrom, markCPU(procs, w.serverPID), snapshotAll(proxies, false), smp.snapshot(), sweepChecks(b, procs))
		costLogged = true
		// The docs are there, but jobs may still be queued: the first reconciliation sweep and
		// the rules' catch-up both enqueue every db, and the loads' own events may still be on
		// their way. Those runs find nothing new; the writer starts once they are done, so that
		// the figures are the steady state's.
		drained := func() bool {
			jobs := consumerJobs(ctx, js)
			if len(jobs) == 0 {
				return false // JetStream did not answer in time
			}
			for _, j := range jobs {
				if j.Pending+j.InFlight > 0 {
					return false
				}
			}
			return true
		}
		waitFor(b, max(5*time.Minute, w.syncLimit), s.key+": queues drained after the initial sync", procs, drained)
		b.Logf("%s: initial sync %v, queues drained after %v", s.key, res.initialSync, time.Since(started))
	}
	res.synced = onTarget

	arrived := watchArrivals(ctx, b, cs, target)
	updates := watchDBUpdates(ctx, b, writer)
	// Let the initial sync's last jobs and checkpoints settle before counting.
	time.Sleep(2 * time.Second)
	before := snapshotAll(proxies, true)
	feedsBefore := hotFeedsOpened(b, procs)

	written := map[string]time.Time{}
	type sentTo struct {
		db string
		at time.Time
	}
	sent := map[string]sentTo{}
	rng := rand.New(rand.NewPCG(1, 2))
	interval := time.Duration(float64(time.Second) / w.rate)
	res.writerStart = time.Since(started)
	end := time.Now().Add(w.duration)
	for i, next := 0, time.Now(); next.Before(end); i, next = i+1, next.Add(interval) {
		time.Sleep(time.Until(next))
		id := fmt.Sprintf("w%06d", i)
		db := users[rng.IntN(w.active)]
		sent[id] = sentTo{db, time.Now()}
		writer.Put(b, db, id, map[string]any{"i": i, "at": time.Now().UnixNano()})
		written[id] = time.Now()
	}
	res.writerEnd = time.Since(started)
	res.written = len(written)
	done := func() bool {
		a, h := arrived.snapshot(), sink.snapshot()
		for id := range written {
			if _, ok := a[id]; !ok {
				return false
			}
			if _, ok := h[id]; !ok && !s.replicatorDB {
				return false
			}
		}
		return true
	}
	for deadline := time.Now().Add(60 * time.Second); !done() && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	after := snapshotAll(proxies, false)
	// A doc a hot feed delivered may be there before its _db_updates row (CouchDB writes the feed
	// every max_write_delay): the rows still due are waited for, after the counts.
	rowsSeen := func() bool {
		for _, s := range sent {
			if _, ok := updates.after(s.db, s.at); !ok {
				return false
			}
		}
		return true
	}
	for deadline := time.Now().Add(10 * time.Second); !rowsSeen() && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	res.hotFeedsOpened = -1
	if feedsBefore >= 0 {
		res.hotFeedsOpened = hotFeedsOpened(b, procs) - feedsBefore
	}
	a, h := arrived.snapshot(), sink.snapshot()
	for id, at := range written {
		rec := benchdata.Write{AtS: at.Sub(started).Seconds(), ReplMS: -1, HookMS: -1, UpdatesMS: new(float64(-1))}
		if t, ok := updates.after(sent[id].db, sent[id].at); ok {
			*rec.UpdatesMS = ms(max(0, t.Sub(at)))
		}
		if t, ok := a[id]; ok {
			res.repl = append(res.repl, max(0, t.Sub(at)))
			rec.ReplMS = ms(max(0, t.Sub(at)))
		} else {
			res.lostRepl++
		}
		if !s.replicatorDB {
			if t, ok := h[id]; ok {
				res.hook = append(res.hook, max(0, t.Sub(at)))
				rec.HookMS = ms(max(0, t.Sub(at)))
			} else {
				res.lostHook++
			}
		}
		res.writes = append(res.writes, rec)
	}
	slices.SortFunc(res.writes, func(x, y benchdata.Write) int { return cmp.Compare(x.AtS, y.AtS) })
	res.requests, res.maxConns = diffCounts(before, after)

	res.idleStart = time.Since(started)
	idleStart := snapshotAll(proxies, true)
	time.Sleep(w.idle)
	idleEnd := snapshotAll(proxies, false)
	res.idleEnd = time.Since(started)
	res.idle, _ = diffCounts(idleStart, idleEnd)
	res.idleFor = w.idle
	res.idleConns = map[string]int{}
	for name, s := range idleEnd {
		res.idleConns[name] = s.open
	}
	stopSampling()
	res.samples = smp.stop()
	res.loadEnd = loadAvg()
	for _, p := range procs {
		_ = p.stop(20 * time.Second)
	}
	if s.replicatorDB {
		stopReplicatorJobs(b, cs, users)
	}
	return res
}

// loadDBs creates the user dbs with docsPerDB docs each, a few at a time (10,000 dbs one by one
// take CouchDB 20 minutes on two cores), and deletes them, a few at a time, when the benchmark ends.
func loadDBs(b *testing.B, cs *couchtest.Server, writer *couchtest.Server, users []string, docsPerDB int, opts ...kivik.Option) {
	b.Helper()
	const workers = 8
	each := func(f func(i int, db string) error) error {
		idx := make(chan int)
		errc := make(chan error, workers)
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for i := range idx {
					if err := f(i, users[i]); err != nil {
						errc <- err
						return
					}
				}
			})
		}
		var err error
	feed:
		for i := range users {
			select {
			case idx <- i:
			case err = <-errc:
				break feed
			}
		}
		close(idx)
		wg.Wait()
		close(errc)
		return cmp.Or(err, <-errc)
	}
	b.Cleanup(func() {
		_ = each(func(_ int, db string) error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = cs.Client.DestroyDB(ctx, db)
			return nil
		})
	})
	err := each(func(i int, db string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := cs.Client.CreateDB(ctx, db, opts...); err != nil {
			return fmt.Errorf("create %s: %w", db, err)
		}
		docs := make([]map[string]any, docsPerDB)
		for j := range docs { // ids unique across dbs: they all meet in the target
			docs[j] = map[string]any{"_id": fmt.Sprintf("init%05d_%03d", i, j), "n": j}
		}
		if err := writer.Do(b, http.MethodPost, "/"+couchtest.PathDB(db)+"/_bulk_docs", map[string]any{"docs": docs}, nil); err != nil {
			return fmt.Errorf("load %s: %w", db, err)
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

// sweepChecks returns the producer's spiegel_sweep_checks_total by answer ("" without a
// producer): the sweep's questions to CouchDB.
func sweepChecks(b testing.TB, procs []*proc) string {
	p := producerProc(procs)
	if p == nil {
		return ""
	}
	m := healthtest.Scrape(b, p.addr)
	var parts []string
	for _, then := range []string{"unchanged", "changed", "failed"} {
		parts = append(parts, fmt.Sprintf("%s %.0f", then, m.Get("spiegel_sweep_checks_total", "then", then)))
	}
	return strings.Join(parts, ", ")
}

// hotFeedsOpened returns the producer's spiegel_hot_feeds_opened_total (-1 without a producer).
func hotFeedsOpened(b testing.TB, procs []*proc) float64 {
	p := producerProc(procs)
	if p == nil {
		return -1
	}
	return healthtest.Scrape(b, p.addr).Get("spiegel_hot_feeds_opened_total")
}

// producerProc returns the producer among procs (nil: none).
func producerProc(procs []*proc) *proc {
	for _, p := range procs {
		if p.name == "producer" {
			return p
		}
	}
	return nil
}

// loadAvg returns the first three fields of /proc/loadavg ("" when unreadable).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// pipelineURL returns the URL the bench's processes reach the server at: the server itself when
// it has its own _db_updates (Apache CouchDB), as in production, and up on PouchDB Server, whose
// feed the test proxy serves. Through up, every request would cross one more proxy in the bench
// process, which would take its time and CPU from the figures.
func pipelineURL(cs *couchtest.Server, up *couchtest.UpdatesProxy) string {
	if up.Synthetic() {
		return up.URL()
	}
	return cs.URL
}

// startPipeline installs a spiegel db and starts the three binaries, each through its own
// counting proxy in front of the server (unless direct; see pipelineURL), with rules for the
// workload.
func startPipeline(b *testing.B, root string, cs *couchtest.Server, up *couchtest.UpdatesProxy, prefix, target, hookURL string, vars []string, direct bool) ([]*proc, map[string]*countingProxy, *natstest.Server) {
	b.Helper()
	serverURL := pipelineURL(cs, up)
	binDir := cmp.Or(os.Getenv("BENCH_BIN_DIR"), filepath.Join(root, "bin")) // another build's binaries, to compare
	bin := func(name string) string { return filepath.Join(binDir, name) }
	ns := natstest.Start(b)
	spiegelDB := prefix + "spiegel"
	up.Server().Cleanup(b, spiegelDB)
	proxies := map[string]*countingProxy{}
	env := func(name string) []string {
		couchURL := serverURL
		if !direct {
			p := newCountingProxy(b, serverURL, spiegelDB)
			proxies[name] = p
			couchURL = p.urlFor(serverURL)
		}
		return baseEnv(append([]string{
			"SPIEGEL_COUCHDB_URL=" + couchURL,
			"SPIEGEL_DB_NAME=" + spiegelDB,
			"SPIEGEL_NATS_URL=" + ns.URL(),
			"SPIEGEL_LOG_LEVEL=" + cmp.Or(os.Getenv("BENCH_LOG_LEVEL"), "warn"),
		}, append(pprofVars(b), vars...)...)...)
	}
	install := baseEnv("SPIEGEL_COUCHDB_URL="+serverURL, "SPIEGEL_DB_NAME="+spiegelDB, "SPIEGEL_NATS_URL="+ns.URL())
	if out, code := runCmd(b, bin("producer"), install, "install"); code != 0 {
		b.Fatalf("producer install:\n%s", out)
	}
	writer := up.Server()
	pattern := "^" + prefix + "u"
	writer.Put(b, spiegelDB, "fan_in", map[string]any{"type": "replicator", "db_name": pattern, "source": "$db_name", "target": target})
	writer.Put(b, spiegelDB, "hook", map[string]any{"type": "on_change", "db_name": pattern, "url": hookURL + "/hook",
		"params": map[string]any{"id": "$change.id"}})
	var procs []*proc
	for _, name := range []string{"producer", "replicator", "onchange"} {
		addr := freeAddr(b)
		procs = append(procs, startProc(b, name, bin(name), addr, append(env(name), "SPIEGEL_HTTP_ADDR="+addr)))
	}
	for _, p := range procs {
		waitFor(b, 30*time.Second, p.name+" ready", procs, func() bool { code, _ := p.get("/readyz"); return code == http.StatusOK })
	}
	return procs, proxies, ns
}

type proxySnapshot struct {
	counts         map[string]int
	open, maxConns int
}

func snapshotAll(proxies map[string]*countingProxy, resetMax bool) map[string]proxySnapshot {
	out := map[string]proxySnapshot{}
	for name, p := range proxies {
		c, open, mx := p.snapshot(resetMax)
		out[name] = proxySnapshot{counts: c, open: open, maxConns: mx}
	}
	return out
}

// diffCounts returns the requests made between two snapshots, by process and endpoint, and the
// most connections each process held meanwhile.
func diffCounts(before, after map[string]proxySnapshot) (map[string]map[string]int, map[string]int) {
	reqs, conns := map[string]map[string]int{}, map[string]int{}
	for name, a := range after {
		eps := map[string]int{}
		for ep, n := range a.counts {
			if d := n - before[name].counts[ep]; d > 0 {
				eps[ep] = d
			}
		}
		reqs[name], conns[name] = eps, a.maxConns
	}
	return reqs, conns
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// BENCH_SETUPS picks the setups and their order; a name that is no setup is refused, naming it.
func TestWorkloadSetups(t *testing.T) {
	keys := func(pick string) []string {
		t.Setenv("BENCH_SETUPS", pick)
		setups, err := workloadSetups()
		require.NoError(t, err)
		var out []string
		for _, s := range setups {
			out = append(out, s.key)
		}
		return out
	}
	assert.Equal(t, []string{"nohot", "hot"}, keys("nohot,hot"), "the order given is the order run")
	assert.Equal(t, []string{"hot", "replicator"}, keys("hot,replicator,hot"), "a setup named twice runs once")
	assert.Equal(t, []string{"hot", "nohot", "direct", "capped", "uncapped", "couchdb", "replicator"}, keys(""))

	t.Setenv("BENCH_SETUPS", "hot,nohots")
	_, err := workloadSetups()
	require.ErrorContains(t, err, `"nohots" is not a setup`)
}
