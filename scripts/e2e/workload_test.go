package e2e

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
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
// Setups, all measured in the same run (BENCH_SETUPS picks some, comma-separated):
//   - hot: the defaults (native engine, hot feeds);
//   - nohot: native engine, SPIEGEL_HOT_FEEDS=0 (the _db_updates path alone);
//   - couchdb: the couchdb engine (POST /_replicate), SPIEGEL_HOT_FEEDS=0 — the earlier default;
//   - replicator: CouchDB's own _replicator, one continuous job per user db (Apache CouchDB
//     only; no on_change).
//
// On PouchDB Server the _db_updates feed is the test proxy's (couchtest.UpdatesProxy), which
// batches writes for 500 ms like CouchDB 3's default max_write_delay. Tunables: BENCH_DBS (100),
// BENCH_RATE (10), BENCH_DURATION (20s), BENCH_IDLE (15s). BENCH_REPORT_DIR gets workload.md.
func BenchmarkWorkload(b *testing.B) {
	root := repoRoot(b, "producer", "replicator", "onchange")
	cs := couchtest.Get(b)
	w := workloadFromEnv(b)
	up := cs.NewUpdatesProxy(b, couchtest.CoalesceWindow(500*time.Millisecond))
	var results []workloadResult
	for range b.N {
		results = results[:0]
		for _, s := range workloadSetups() {
			if s.replicatorDB && cs.PouchDB {
				b.Logf("%s: skipped (PouchDB Server has no _replicator scheduler)", s.key)
				continue
			}
			r := runWorkload(b, root, cs, up, w, s)
			b.Logf("%s: %s", s.key, r.summary())
			results = append(results, r)
		}
	}
	byKey := map[string]workloadResult{}
	for _, r := range results {
		byKey[r.setup.key] = r
	}
	if hot, ok := byKey["hot"]; ok {
		b.ReportMetric(ms(percentile(hot.repl, 0.99)), "repl-p99-ms")
		b.ReportMetric(ms(percentile(hot.hook, 0.99)), "hook-p99-ms")
		b.ReportMetric(hot.perDoc(hot.total()), "req/doc")
		b.ReportMetric(hot.perDoc(hot.spiegelWrites()), "spiegel-writes/doc")
		b.ReportMetric(hot.idleRate(), "idle-req/s")
		for _, base := range []string{"nohot", "couchdb", "replicator"} {
			if r, ok := byKey[base]; ok && len(r.repl) > 0 {
				b.ReportMetric(ms(percentile(hot.repl, 0.99))/ms(percentile(r.repl, 0.99)), "repl-p99-vs-"+base)
			}
		}
	}
	if dir := os.Getenv("BENCH_REPORT_DIR"); dir != "" {
		report := workloadReport(cs, w, results)
		if err := os.WriteFile(filepath.Join(dir, "workload.md"), []byte(report), 0o644); err != nil {
			b.Fatalf("write report: %v", err)
		}
	}
}

type workload struct {
	dbs, docsPerDB, active int
	rate                   float64
	duration, idle         time.Duration
}

func workloadFromEnv(b *testing.B) workload {
	w := workload{dbs: 100, docsPerDB: 10, rate: 10, duration: 20 * time.Second, idle: 15 * time.Second}
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
	for name, d := range map[string]*time.Duration{"BENCH_DURATION": &w.duration, "BENCH_IDLE": &w.idle} {
		if v := os.Getenv(name); v != "" {
			x, err := time.ParseDuration(v)
			if err != nil || x <= 0 {
				b.Fatalf("%s=%q: want a duration such as 20s", name, v)
			}
			*d = x
		}
	}
	w.active = max(1, w.dbs/10)
	return w
}

type workloadSetup struct {
	key, name    string
	vars         []string // SPIEGEL_ variables of the three processes
	replicatorDB bool
}

func workloadSetups() []workloadSetup {
	all := []workloadSetup{
		{key: "hot", name: "native engine, hot feeds (defaults)"},
		{key: "nohot", name: "native engine, no hot feeds", vars: []string{"SPIEGEL_HOT_FEEDS=0"}},
		{key: "couchdb", name: "couchdb engine, no hot feeds (earlier default)",
			vars: []string{"SPIEGEL_HOT_FEEDS=0", "SPIEGEL_REPLICATION_ENGINE=couchdb"}},
		{key: "replicator", name: "CouchDB _replicator, one continuous job per db", replicatorDB: true},
	}
	pick := os.Getenv("BENCH_SETUPS")
	if pick == "" {
		return all
	}
	keys := strings.Split(pick, ",")
	return slices.DeleteFunc(all, func(s workloadSetup) bool { return !slices.Contains(keys, s.key) })
}

// workloadResult is what one setup measured.
type workloadResult struct {
	setup       workloadSetup
	written     int
	initialSync time.Duration
	repl, hook  []time.Duration // per written doc that arrived
	lostRepl    int             // written docs not on the target within the drain deadline
	lostHook    int
	// by process (producer, replicator, onchange), by endpoint
	requests, idle map[string]map[string]int
	idleFor        time.Duration
	maxConns       map[string]int
	idleConns      map[string]int
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
		"connections max %v, open when idle %v",
		r.written, ms(percentile(r.repl, 0.5)), ms(percentile(r.repl, 0.99)), r.lostRepl,
		ms(percentile(r.hook, 0.5)), ms(percentile(r.hook, 0.99)), r.lostHook, r.perDoc(r.total()), r.maxConns, r.idleConns)
}

// runWorkload installs a fresh pipeline (or _replicator jobs), loads the dbs, waits for the
// initial sync, runs the writer, waits for delivery and then watches the idle pipeline.
func runWorkload(b *testing.B, root string, cs *couchtest.Server, up *couchtest.UpdatesProxy, w workload, s workloadSetup) workloadResult {
	b.Helper()
	res := workloadResult{setup: s}
	writer := up.Server()
	prefix := couchtest.UniqueName(b, "bench_"+s.key+"_") + "_"
	target := prefix + "target"
	users := make([]string, w.dbs)
	for i := range users {
		users[i] = fmt.Sprintf("%su%05d", prefix, i)
	}
	cs.CreateDB(b, target)
	for i, db := range users {
		cs.CreateDB(b, db)
		docs := make([]map[string]any, w.docsPerDB)
		for j := range docs { // ids unique across dbs: they all meet in the target
			docs[j] = map[string]any{"_id": fmt.Sprintf("init%05d_%03d", i, j), "n": j}
		}
		if err := writer.Do(b, http.MethodPost, "/"+couchtest.PathDB(db)+"/_bulk_docs", map[string]any{"docs": docs}, nil); err != nil {
			b.Fatalf("load %s: %v", db, err)
		}
	}
	initial := w.dbs * w.docsPerDB
	sink := newLatencySink(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var procs []*proc
	var proxies map[string]*countingProxy
	started := time.Now()
	if s.replicatorDB {
		for _, db := range users {
			doc := map[string]any{"source": cs.URL + "/" + couchtest.PathDB(db), "target": cs.URL + "/" + couchtest.PathDB(target), "continuous": true}
			id := "bench_" + db
			cs.Put(b, "_replicator", id, doc)
			b.Cleanup(func() {
				var cur struct {
					Rev string `json:"_rev"`
				}
				if cs.Do(b, http.MethodGet, "/_replicator/"+id, nil, &cur) == nil {
					_ = cs.Do(b, http.MethodDelete, "/_replicator/"+id+"?rev="+cur.Rev, nil, nil)
				}
			})
		}
	} else {
		procs, proxies = startPipeline(b, root, up, prefix, target, sink.URL, s.vars)
	}
	var onTarget int
	b.Cleanup(func() {
		if b.Failed() {
			b.Logf("%s: %d of %d docs on the target, %d at the webhook", s.key, onTarget, initial, sink.distinct())
		}
	})
	waitFor(b, 5*time.Minute, s.key+": initial sync", procs, func() bool {
		onTarget = docCount(b, cs, target)
		return onTarget >= initial && (s.replicatorDB || sink.distinct() >= initial)
	})
	res.initialSync = time.Since(started)

	arrived := watchArrivals(ctx, b, cs, target)
	// Let the initial sync's last jobs and checkpoints settle before counting.
	time.Sleep(2 * time.Second)
	before := snapshotAll(proxies, true)

	written := map[string]time.Time{}
	rng := rand.New(rand.NewPCG(1, 2))
	interval := time.Duration(float64(time.Second) / w.rate)
	end := time.Now().Add(w.duration)
	for i, next := 0, time.Now(); next.Before(end); i, next = i+1, next.Add(interval) {
		time.Sleep(time.Until(next))
		id := fmt.Sprintf("w%06d", i)
		db := users[rng.IntN(w.active)]
		writer.Put(b, db, id, map[string]any{"i": i, "at": time.Now().UnixNano()})
		written[id] = time.Now()
	}
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
	a, h := arrived.snapshot(), sink.snapshot()
	for id, at := range written {
		if t, ok := a[id]; ok {
			res.repl = append(res.repl, max(0, t.Sub(at)))
		} else {
			res.lostRepl++
		}
		if s.replicatorDB {
			continue
		}
		if t, ok := h[id]; ok {
			res.hook = append(res.hook, max(0, t.Sub(at)))
		} else {
			res.lostHook++
		}
	}
	res.requests, res.maxConns = diffCounts(before, after)

	idleStart := snapshotAll(proxies, true)
	time.Sleep(w.idle)
	idleEnd := snapshotAll(proxies, false)
	res.idle, _ = diffCounts(idleStart, idleEnd)
	res.idleFor = w.idle
	res.idleConns = map[string]int{}
	for name, s := range idleEnd {
		res.idleConns[name] = s.open
	}
	for _, p := range procs {
		_ = p.stop(20 * time.Second)
	}
	return res
}

// startPipeline installs a spiegel db and starts the three binaries, each through its own
// counting proxy in front of up, with rules for the workload.
func startPipeline(b *testing.B, root string, up *couchtest.UpdatesProxy, prefix, target, hookURL string, vars []string) ([]*proc, map[string]*countingProxy) {
	b.Helper()
	bin := func(name string) string { return filepath.Join(root, "bin", name) }
	ns := natstest.Start(b)
	spiegelDB := prefix + "spiegel"
	up.Server().Cleanup(b, spiegelDB)
	proxies := map[string]*countingProxy{}
	env := func(name string) []string {
		p := newCountingProxy(b, up.URL(), spiegelDB)
		proxies[name] = p
		return baseEnv(append([]string{
			"SPIEGEL_COUCHDB_URL=" + p.urlFor(up.URL()),
			"SPIEGEL_DB_NAME=" + spiegelDB,
			"SPIEGEL_NATS_URL=" + ns.URL(),
			"SPIEGEL_LOG_LEVEL=" + cmp.Or(os.Getenv("BENCH_LOG_LEVEL"), "warn"),
		}, vars...)...)
	}
	install := baseEnv("SPIEGEL_COUCHDB_URL="+up.URL(), "SPIEGEL_DB_NAME="+spiegelDB, "SPIEGEL_NATS_URL="+ns.URL())
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
	return procs, proxies
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

// latencySink is the webhook: it records when each doc id was first called for.
type latencySink struct {
	*httptest.Server
	mu    sync.Mutex
	first map[string]time.Time
}

func newLatencySink(b testing.TB) *latencySink {
	s := &latencySink{first: map[string]time.Time{}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		id := r.URL.Query().Get("id")
		s.mu.Lock()
		if _, ok := s.first[id]; !ok {
			s.first[id] = now
		}
		s.mu.Unlock()
	}))
	b.Cleanup(s.Close)
	return s
}

func (s *latencySink) snapshot() map[string]time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]time.Time, len(s.first))
	for k, v := range s.first {
		out[k] = v
	}
	return out
}

func (s *latencySink) distinct() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.first)
}

// arrivals records when each doc id first appeared on a db's continuous _changes feed.
type arrivals struct {
	mu    sync.Mutex
	first map[string]time.Time
}

func (a *arrivals) snapshot() map[string]time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]time.Time, len(a.first))
	for k, v := range a.first {
		out[k] = v
	}
	return out
}

// watchArrivals follows db's changes from now, straight from the server, until ctx ends.
func watchArrivals(ctx context.Context, b testing.TB, cs *couchtest.Server, db string) *arrivals {
	a := &arrivals{first: map[string]time.Time{}}
	ready := make(chan struct{})
	var connected sync.Once
	go func() {
		since := "now"
		for ctx.Err() == nil {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet,
				cs.URL+"/"+couchtest.PathDB(db)+"/_changes?feed=continuous&heartbeat=2000&since="+since, nil)
			if err != nil {
				return
			}
			resp, err := cs.HTTP.Do(req)
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			connected.Do(func() { close(ready) })
			sc := bufio.NewScanner(resp.Body)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				var row struct {
					ID  string          `json:"id"`
					Seq json.RawMessage `json:"seq"`
				}
				if json.Unmarshal(sc.Bytes(), &row) != nil || row.ID == "" {
					continue
				}
				now := time.Now()
				a.mu.Lock()
				if _, ok := a.first[row.ID]; !ok {
					a.first[row.ID] = now
				}
				a.mu.Unlock()
				if s, err := strconv.Unquote(string(row.Seq)); err == nil {
					since = s
				} else if len(row.Seq) > 0 {
					since = string(row.Seq)
				}
			}
			resp.Body.Close()
		}
	}()
	select {
	case <-ready:
	case <-time.After(30 * time.Second):
		b.Fatalf("cannot follow the changes of %s", db)
	}
	return a
}

func docCount(b testing.TB, cs *couchtest.Server, db string) int {
	var info struct {
		DocCount int `json:"doc_count"`
	}
	if err := cs.Do(b, http.MethodGet, "/"+couchtest.PathDB(db), nil, &info); err != nil {
		return 0
	}
	return info.DocCount
}

func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// workloadReport renders the results as Markdown.
func workloadReport(cs *couchtest.Server, w workload, results []workloadResult) string {
	var sb strings.Builder
	server := "Apache CouchDB " + cs.Version
	if cs.PouchDB {
		server = "PouchDB Server (its _db_updates from the test proxy, 500 ms batches)"
	}
	fmt.Fprintf(&sb, "## Workload: %d dbs × %d docs, %d active, %.0f docs/s for %s\n\n", w.dbs, w.docsPerDB, w.active, w.rate, w.duration)
	fmt.Fprintf(&sb, "Server: %s. One pattern replicator rule (every user db into one target) and one on_change rule (a GET per change to a local webhook). "+
		"Latency: from the write's answer to the doc on the target's feed, or at the webhook. Requests: CouchDB requests by the pipeline's processes while the writer ran and until every doc arrived, per written doc.\n\n", server)
	sb.WriteString("| setup | initial sync | replication p50 / p95 / p99 | webhook p50 / p95 / p99 | lost | requests/doc | spiegel-db writes/doc | max connections | idle requests/s (connections open) |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		hook := "—"
		if !r.setup.replicatorDB {
			hook = fmt.Sprintf("%.0f / %.0f / %.0f ms", ms(percentile(r.hook, 0.5)), ms(percentile(r.hook, 0.95)), ms(percentile(r.hook, 0.99)))
		}
		reqs, writes, conns, idle := "—", "—", "—", "—"
		if !r.setup.replicatorDB {
			reqs = fmt.Sprintf("%.2f", r.perDoc(r.total()))
			writes = fmt.Sprintf("%.2f", r.perDoc(r.spiegelWrites()))
			n, o := 0, 0
			for name, c := range r.maxConns {
				n += c
				o += r.idleConns[name]
			}
			conns = strconv.Itoa(n)
			idle = fmt.Sprintf("%.2f (%d)", r.idleRate(), o)
		}
		fmt.Fprintf(&sb, "| %s | %.1f s | %.0f / %.0f / %.0f ms | %s | %d / %d | %s | %s | %s | %s |\n",
			r.setup.name, r.initialSync.Seconds(), ms(percentile(r.repl, 0.5)), ms(percentile(r.repl, 0.95)), ms(percentile(r.repl, 0.99)),
			hook, r.lostRepl, r.lostHook, reqs, writes, conns, idle)
	}
	for _, r := range results {
		if r.setup.replicatorDB {
			continue
		}
		fmt.Fprintf(&sb, "\n### Requests per written doc: %s\n\n| process | endpoint | per doc | while idle, per s |\n|---|---|---|---|\n", r.setup.name)
		for _, name := range []string{"producer", "replicator", "onchange"} {
			eps := map[string]bool{}
			for ep := range r.requests[name] {
				eps[ep] = true
			}
			for ep := range r.idle[name] {
				eps[ep] = true
			}
			keys := make([]string, 0, len(eps))
			for ep := range eps {
				keys = append(keys, ep)
			}
			sort.Strings(keys)
			for _, ep := range keys {
				fmt.Fprintf(&sb, "| %s | `%s` | %.2f | %.2f |\n", name, ep, r.perDoc(r.requests[name][ep]),
					float64(r.idle[name][ep])/r.idleFor.Seconds())
			}
		}
	}
	return sb.String()
}
