package e2e

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
)

// streamsPage is the loop's page size: changes per _changes request, published before the next.
const streamsPage = 1000

// streamsRun is one (workload, topology) of BenchmarkStreams: its four variants in turn.
type streamsRun struct {
	root     string
	cs       *couchtest.Server // the loop reads it directly
	couchURL string            // the pipeline's (the updates proxy on PouchDB Server)
	writer   *couchtest.Server // rule docs
	cfg      streamsConfig
	w        streamsWorkload
	row      *streamsRow
	rep      *streamsReport
	n        *streamsNATS
}

func (r *streamsRun) run(b *testing.B) {
	r.row.loadFrom = loadAvg()
	r.n = startStreamsNATS(b, r.row.topology)
	settle()
	r.row.loop1 = r.loop(b, 1)
	settle()
	r.row.subject = r.subjectRule(b)
	settle()
	r.row.mirror = r.mirrorRule(b)
	settle()
	r.row.loop2 = r.loop(b, 2)
	r.row.loadTo = loadAvg()
	r.rep.write(b)
	b.Logf("%s %s: %s", r.w, r.row.topology, r.row.summary())
}

// settle lets what the previous variant left behind (garbage, CouchDB's and NATS' own writes
// after it) pass before the next one starts. Nothing is judged by it.
func settle() {
	runtime.GC()
	time.Sleep(2 * time.Second)
}

// fail records where variant v stopped, writes the report with it and fails the benchmark.
func (r *streamsRun) fail(b *testing.B, v *streamsVariant, format string, args ...any) {
	b.Helper()
	msg := fmt.Sprintf(format, args...)
	r.row.failed = v.name + ": " + msg
	r.row.loadTo = loadAvg()
	r.rep.write(b)
	b.Fatalf("%s %s, %s: %s", r.w, r.row.topology, v.name, msg)
}

// loopChange is what the loop publishes: the change row with its db, as a subject rule does.
type loopChange struct {
	DB string `json:"db"`
	changeRow
}

// loop is the baseline: each db in turn, _changes in pages of streamsPage with the docs, every
// change of a page published asynchronously to a fresh stream, the page's acks awaited before
// the next page.
func (r *streamsRun) loop(b *testing.B, run int) *streamsVariant {
	b.Helper()
	v := &streamsVariant{name: fmt.Sprintf("loop, run %d", run)}
	stream := fmt.Sprintf("BENCH_LOOP_%d", run)
	r.n.createStream(b, r.n.streamConfig(stream, "loop.>"))
	total := r.w.changes()
	cpu := r.startCPU(nil)
	start := time.Now()
	ctx, cancel := context.WithDeadline(b.Context(), start.Add(r.cfg.limit))
	defer cancel()
	acked := 0
	progress := func() string {
		return fmt.Sprintf("%d of %d changes acknowledged after %s", acked, total, time.Since(start).Round(time.Millisecond))
	}
	for i := range r.w.dbs {
		db := r.w.dbName(i)
		subject := "loop." + events.EncodeDBName(db)
		since := "0"
		for {
			page, err := readChangesPage(ctx, r.cs, db, since, streamsPage)
			if err != nil {
				r.fail(b, v, "%s, then reading %s since %s: %v (BENCH_STREAMS_LIMIT=%s)", progress(), db, since, err, r.cfg.limit)
			}
			futures := make([]jetstream.PubAckFuture, 0, len(page.Results))
			for _, c := range page.Results {
				data, err := json.Marshal(loopChange{DB: db, changeRow: c})
				if err != nil {
					r.fail(b, v, "%s, then encoding %s/%s: %v", progress(), db, c.ID, err)
				}
				rev := ""
				if len(c.Changes) > 0 {
					rev = c.Changes[0].Rev
				}
				f, err := r.n.js.PublishMsgAsync(&nats.Msg{Subject: subject, Data: data}, jetstream.WithMsgID(db+"/"+c.ID+"/"+rev))
				if err != nil {
					r.fail(b, v, "%s, then publishing %s/%s: %v", progress(), db, c.ID, err)
				}
				futures = append(futures, f)
			}
			for _, f := range futures {
				select {
				case <-f.Ok():
					acked++
				case err := <-f.Err():
					r.fail(b, v, "%s, then a publish failed: %v", progress(), err)
				case <-ctx.Done():
					r.fail(b, v, "%s (BENCH_STREAMS_LIMIT=%s)", progress(), r.cfg.limit)
				}
			}
			since = seqString(page.LastSeq)
			if len(page.Results) == 0 || page.Pending != nil && *page.Pending == 0 {
				break
			}
		}
	}
	v.dur, v.count = time.Since(start), acked
	v.cpu = cpu.stop()
	if acked != total {
		r.fail(b, v, "the dbs' feeds had %d changes, want %d (one per doc)", acked, total)
	}
	if n, err := r.n.streamMsgs(stream); err != nil || n != total {
		r.fail(b, v, "stream %s holds %d messages (%v), want %d", stream, n, err, total)
	}
	r.n.deleteStream(b, stream)
	return v
}

// subjectRule times a `subject` rule from its doc's creation until its stream holds every change.
func (r *streamsRun) subjectRule(b *testing.B) *streamsVariant {
	b.Helper()
	v := &streamsVariant{name: "subject rule"}
	const stream, subjects = "BENCH_CHANGES", "bench.changes.>"
	r.n.createStream(b, r.n.streamConfig(stream, subjects))
	p := r.startPipeline(b, "subject")
	cpu := r.startCPU(p.procs)
	start := time.Now()
	p.putRule(b, r.writer, map[string]any{"type": "on_change", "db_name": r.w.pattern(), "subject": "bench.changes.${db_name}"})
	r.await(b, v, start, p.procs, "changes in stream "+stream, func() (int, error) { return r.n.streamMsgs(stream) })
	v.cpu = cpu.stop()
	st, err := r.n.streamState(stream, subjects)
	if err != nil {
		r.fail(b, v, "read stream %s: %v", stream, err)
	}
	for i := range r.w.dbs {
		db := r.w.dbName(i)
		if got := st.Subjects["bench.changes."+events.EncodeDBName(db)]; int(got) != r.w.docs {
			r.fail(b, v, "stream %s holds %d changes of %s, want %d (%d in all)", stream, got, db, r.w.docs, st.Msgs)
		}
	}
	p.finish(b, v)
	r.n.deleteStream(b, stream)
	return v
}

// mirrorRule times a `mirror` rule from its doc's creation until its bucket holds every doc's key.
func (r *streamsRun) mirrorRule(b *testing.B) *streamsVariant {
	b.Helper()
	v := &streamsVariant{name: "mirror rule"}
	const bucket = "BENCH_MIRROR"
	r.n.createBucket(b, bucket)
	p := r.startPipeline(b, "mirror")
	cpu := r.startCPU(p.procs)
	start := time.Now()
	p.putRule(b, r.writer, map[string]any{"type": "on_change", "db_name": r.w.pattern(), "mirror": bucket})
	r.await(b, v, start, p.procs, "doc keys in bucket "+bucket, func() (int, error) { return r.n.bucketDocKeys(bucket) })
	v.cpu = cpu.stop()
	for i := range r.w.dbs {
		db := r.w.dbName(i)
		if got, err := r.n.bucketKeysOf(bucket, db); err != nil || got != r.w.docs {
			r.fail(b, v, "bucket %s holds %d keys of %s (%v), want %d", bucket, got, db, err, r.w.docs)
		}
	}
	p.finish(b, v)
	r.n.deleteStream(b, "KV_"+bucket)
	return v
}

// await polls count every 50 ms until it reaches the workload's changes, and records the time
// since start; it fails the benchmark, saying how far count got, when a process exits or the
// limit passes.
func (r *streamsRun) await(b *testing.B, v *streamsVariant, start time.Time, procs []*proc, what string, count func() (int, error)) {
	b.Helper()
	total := r.w.changes()
	deadline := start.Add(r.cfg.limit)
	got := 0
	var lastErr error
	for {
		n, err := count()
		if err == nil {
			got = n
		}
		lastErr = err
		if got >= total {
			v.dur, v.count = time.Since(start), got
			return
		}
		for _, p := range procs {
			if !p.running() {
				r.fail(b, v, "%s exited (%v) after %s, with %d of %d %s; its log (tail):\n%s",
					p.name, p.err, time.Since(start).Round(time.Millisecond), got, total, what, tail(p.out.String(), 20))
			}
		}
		if time.Now().After(deadline) {
			r.fail(b, v, "%d of %d %s after %s (BENCH_STREAMS_LIMIT=%s; last poll error: %v)", got, total, what, time.Since(start).Round(time.Second), r.cfg.limit, lastErr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// streamsPipeline is an installation of the product for one variant: its own spiegel db and
// subject prefix (so its own work stream, checkpoint cache and completion records), a producer
// and one onchange process.
type streamsPipeline struct {
	tag, spiegelDB string
	env            []string
	producerBin    string
	procs          []*proc
	couch          *couchtest.Server
	uninstalled    bool
}

func (r *streamsRun) startPipeline(b *testing.B, variant string) *streamsPipeline {
	b.Helper()
	binDir := cmp.Or(os.Getenv("BENCH_BIN_DIR"), filepath.Join(r.root, "bin"))
	n := time.Now().UnixNano() % 1e9
	p := &streamsPipeline{
		tag:         fmt.Sprintf("%s-%s-%d", r.row.topology, variant, n),
		spiegelDB:   fmt.Sprintf("bench-streams-spiegel-%s-%s-%d", r.row.topology, variant, n),
		producerBin: filepath.Join(binDir, "producer"),
		couch:       r.cs,
	}
	forgetIdentity(b, r.cs, r.w)
	// Deleted when the benchmark ends, should uninstall not have run (a failed variant).
	r.cs.Cleanup(b, p.spiegelDB)
	p.env = baseEnv(append([]string{
		"SPIEGEL_COUCHDB_URL=" + r.couchURL,
		"SPIEGEL_DB_NAME=" + p.spiegelDB,
		"SPIEGEL_NATS_URL=" + r.n.url,
		"SPIEGEL_SUBJECT_PREFIX=" + fmt.Sprintf("bs_%s_%d", variant, n),
		"SPIEGEL_STREAM_REPLICAS=" + strconv.Itoa(r.n.replicas),
		"SPIEGEL_LOG_LEVEL=" + cmp.Or(os.Getenv("BENCH_LOG_LEVEL"), "warn"),
	}, r.cfg.vars...)...)
	if out, code := runCmd(b, p.producerBin, p.env, "install"); code != 0 {
		b.Fatalf("producer install (%s):\n%s", p.tag, out)
	}
	// The rule alone enqueues the dbs (its catch-up): the feed starts from now and the
	// reconciliation sweep is off, so that no second job of a db competes with the first.
	producerAddr, onchangeAddr := freeAddr(b), freeAddr(b)
	p.procs = []*proc{
		startProc(b, "producer", p.producerBin, producerAddr, append(slices.Clone(p.env),
			"SPIEGEL_HTTP_ADDR="+producerAddr, "SPIEGEL_START=now", "SPIEGEL_SWEEP_INTERVAL=0")),
		startProc(b, "onchange", filepath.Join(binDir, "onchange"), onchangeAddr, append(slices.Clone(p.env),
			"SPIEGEL_HTTP_ADDR="+onchangeAddr)),
	}
	// Registered after startProc's own cleanups, so it runs before them: it stops the processes
	// gently and removes the installation of a variant that failed.
	b.Cleanup(func() {
		if !p.uninstalled {
			p.stop(nil)
			p.uninstall(nil)
		}
	})
	for _, pr := range p.procs {
		waitFor(b, time.Minute, fmt.Sprintf("%s %s ready", p.tag, pr.name), p.procs, func() bool {
			code, _ := pr.get("/readyz")
			return code == http.StatusOK
		})
	}
	return p
}

// putRule creates the variant's rule doc, under an id of its own: on_change checkpoints are
// per rule id, so no earlier run's checkpoint applies.
func (p *streamsPipeline) putRule(b *testing.B, writer *couchtest.Server, doc map[string]any) {
	b.Helper()
	writer.Put(b, p.spiegelDB, "bench-streams-"+p.tag, doc)
}

// finish stops the processes, notes in v what their logs said at warn level and above, and
// uninstalls.
func (p *streamsPipeline) finish(b *testing.B, v *streamsVariant) {
	b.Helper()
	p.stop(v)
	for _, pr := range p.procs {
		v.issues = append(v.issues, logIssues(pr.name, pr.out.String())...)
	}
	p.uninstall(v)
	for _, s := range v.issues {
		b.Logf("%s %s: %s", p.tag, v.name, s)
	}
}

// stop stops the processes (SIGTERM, 30 s each), noting a process that did not stop cleanly.
func (p *streamsPipeline) stop(v *streamsVariant) {
	for _, pr := range p.procs {
		if !pr.running() {
			if v != nil {
				v.issues = append(v.issues, fmt.Sprintf("%s had exited (%v)", pr.name, pr.err))
			}
			continue
		}
		if err := pr.stop(30 * time.Second); err != nil && v != nil {
			v.issues = append(v.issues, fmt.Sprintf("%s stopped with %v", pr.name, err))
		}
	}
}

// uninstall removes the installation (`producer uninstall --yes`: the rules' checkpoints in the
// workload's dbs, the prefix's streams and buckets, the spiegel db). It runs in cleanups too, so
// it does not use the benchmark's context.
func (p *streamsPipeline) uninstall(v *streamsVariant) {
	p.uninstalled = true
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, p.producerBin, "uninstall", "--yes")
	cmd.Env = p.env
	if out, err := cmd.CombinedOutput(); err != nil && v != nil {
		v.issues = append(v.issues, fmt.Sprintf("producer uninstall failed (%v): %s", err, strings.TrimSpace(tail(string(out), 5))))
	}
}

// logIssues returns the lines of a process's JSON log at warn level and above, one entry per
// distinct message with its count, in the order they first came.
func logIssues(name, log string) []string {
	counts := map[string]int{}
	var order []string
	for _, line := range strings.Split(log, "\n") {
		var l struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
			Error string `json:"error"`
		}
		if json.Unmarshal([]byte(line), &l) != nil {
			if s := strings.TrimSpace(line); s != "" && !strings.HasPrefix(s, "{") {
				l.Level, l.Msg = "output", s // not a log line: a panic, say
			} else {
				continue
			}
		}
		switch l.Level {
		case "warn", "warning", "error", "fatal", "panic", "output":
		default:
			continue
		}
		key := l.Level + ": " + l.Msg
		if l.Error != "" {
			key += " (" + l.Error + ")"
		}
		if counts[key] == 0 {
			order = append(order, key)
		}
		counts[key]++
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, fmt.Sprintf("%s: %d× %s", name, counts[k], k))
	}
	return out
}

// cpuMeter measures the CPU time of this process (the NATS servers and the loop or the poller),
// the pipeline's processes and, with BENCH_SERVER_PID, the CouchDB server.
type cpuMeter struct {
	pids  map[string]int
	ticks map[string]uint64
}

func (r *streamsRun) startCPU(procs []*proc) *cpuMeter {
	m := &cpuMeter{pids: map[string]int{"bench": os.Getpid()}, ticks: map[string]uint64{}}
	for _, p := range procs {
		m.pids[p.name] = p.cmd.Process.Pid
	}
	if pid, err := strconv.Atoi(os.Getenv("BENCH_SERVER_PID")); err == nil && pid > 0 {
		m.pids["couchdb"] = pid
	}
	for name, pid := range m.pids {
		if t, err := procTicks(pid); err == nil {
			m.ticks[name] = t
		}
	}
	return m
}

// stop returns the CPU seconds each process spent since the meter started.
func (m *cpuMeter) stop() map[string]float64 {
	out := map[string]float64{}
	for name, pid := range m.pids {
		before, ok := m.ticks[name]
		if t, err := procTicks(pid); err == nil && ok {
			out[name] = float64(t-before) / clockTicks
		}
	}
	return out
}

func procTicks(pid int) (uint64, error) {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, err
	}
	return cpuTicks(string(stat))
}
