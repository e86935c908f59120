package chaos

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// run is one chaos run: the servers, the pipeline, the plan, and the run's own log.
type run struct {
	cfg      Config
	plan     Plan
	started  time.Time
	logDir   string
	prefix   string // of every db the run creates
	subjects events.Subjects

	couch   *couchServer
	nats    *cluster
	sink    *sink
	procs   []*proc // the product processes, by procNames index
	changes *streamReader
	probes  *prober
	gaps    *gapWatch // reports of losses, scraped from the processes' metrics

	outMu sync.Mutex
	out   io.Writer // progress: the test's output and run.log

	mu       sync.Mutex
	pids     []int // every process the run started
	journals []*journal
}

// since is the time since the run started.
func (r *run) since() time.Duration { return time.Since(r.started).Round(time.Millisecond) }

// logf writes one progress line, stamped with the run's clock.
func (r *run) logf(format string, args ...any) {
	r.outMu.Lock()
	defer r.outMu.Unlock()
	fmt.Fprintf(r.out, "[chaos +%8.3fs] %s\n", time.Since(r.started).Seconds(), fmt.Sprintf(format, args...))
}

// track records a started process id, for the final "none left running" check.
func (r *run) track(pid int) {
	r.mu.Lock()
	r.pids = append(r.pids, pid)
	r.mu.Unlock()
}

// execute runs cfg from start to verdict and returns the result; it never leaves a process
// running. Progress goes to out (and to run.log in the output dir).
func execute(ctx context.Context, cfg Config, out io.Writer) *Result {
	res := &Result{Cfg: cfg}
	r := &run{cfg: cfg, started: time.Now(), logDir: filepath.Join(cfg.OutDir, "logs"), subjects: events.NewSubjects("spiegel")}
	if err := os.MkdirAll(r.logDir, 0o755); err != nil {
		res.fail("setup: %v", err)
		return res
	}
	runLog, err := os.Create(filepath.Join(cfg.OutDir, "run.log"))
	if err != nil {
		res.fail("setup: %v", err)
		return res
	}
	defer runLog.Close()
	r.out = io.MultiWriter(out, runLog)
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	r.prefix = "chaos_" + hex.EncodeToString(b) + "_"

	r.plan = newPlan(cfg)
	res.Digest, res.PlanSummary = r.plan.Digest(), r.plan.Summary()
	if f, err := os.Create(filepath.Join(cfg.OutDir, "plan.txt")); err == nil {
		r.plan.write(f)
		_ = f.Close()
	}
	r.logf("SEED %d — plan %s: %s", cfg.Seed, res.Digest, res.PlanSummary)
	r.logf("output in %s; db prefix %s", cfg.OutDir, r.prefix)
	defer r.shutdown(res)

	if err := r.setup(ctx, res); err != nil {
		res.fail("setup: %v", err)
		return res
	}
	start := time.Now()
	r.logf("writing and injecting faults for %s", cfg.Duration)
	w := newWriter(r, start)
	f := &faults{r: r, start: start}
	var wg sync.WaitGroup
	progress, stopProgress := context.WithCancel(ctx)
	watching, stopWatching := context.WithCancel(ctx)
	defer stopWatching()
	go r.probes.watch(watching, time.Second)
	go r.gaps.watch(watching, r.metricsURLs, r.since, time.Second)
	wg.Go(func() { w.run(ctx, r.plan.Ops); res.WriterEnd = r.since() })
	wg.Go(func() { f.run(ctx, r.plan.Faults) })
	go r.reportProgress(progress, w)
	wg.Wait()
	stopProgress()
	res.LastFault = f.lastEnd()
	r.logf("writer done at +%s, the last fault ended at +%s; waiting for the pipeline to converge (at most %s)",
		res.WriterEnd, res.LastFault, cfg.QuiesceTimeout)

	res.Faults = f.list()
	for _, rec := range res.Faults {
		if rec.Err != nil {
			res.fail("fault %s at +%s (%s) did not complete: %v", rec.Kind, rec.Started, rec.What, rec.Err)
		}
	}
	res.WriterDone, res.WriterSkipped, res.WriterRetries, res.WriterFailed = w.stats()
	res.WriterDBsLost = w.lostDBs()
	var v *verdict
	checks := 0
	err = waitUntil(ctx, cfg.QuiesceTimeout, 2*time.Second, "convergence", func() bool {
		v = r.check(ctx)
		ready := r.allReady(ctx)
		if checks++; !(v.converged() && ready) && checks%3 == 0 {
			r.logf("still waiting: %s%s", v.pending(ready), r.workConsumers(ctx))
		}
		if v.converged() && ready {
			r.probes.check(ctx)
			return r.probes.healed()
		}
		return false
	})
	stopWatching()
	res.Heal = r.probes.summary()
	res.Converged = r.since()
	if err != nil {
		res.fail("not converged within %s after the writer and the faults stopped", cfg.QuiesceTimeout)
	} else {
		r.logf("converged at +%s: %s after the last fault, %s after the writer's last op", res.Converged,
			(res.Converged - res.LastFault).Round(100*time.Millisecond), (res.Converged - res.WriterEnd).Round(100*time.Millisecond))
	}
	if v != nil {
		account(v, w.deletions(), r.started)
		j := r.newJournal("order")
		for _, o := range v.OrderViolations {
			j.printf("%s", o)
		}
	}
	res.Verdict = v
	if cfg.StoreLoss && v != nil {
		fails, note := storeLossVerdict(v, res.Faults, r.gaps, sweepInterval+2*cfg.AckWait)
		for _, f := range fails {
			res.fail("%s", f)
		}
		res.StoreLossNote = note
	}
	pids := map[string][]int{}
	for _, p := range r.procs {
		pids[p.name] = p.allPIDs()
	}
	overlap := overlapVerdict(r.sink.allCalls(), pids, res.Faults, r.started, time.Now(), cfg.AckWait)
	res.Overlap = &overlap
	oj := r.newJournal("overlap")
	for _, line := range overlap.Violations {
		oj.printf("VIOLATION %s", line)
	}
	for _, line := range overlap.Excused {
		oj.printf("excused %s", line)
	}
	for _, line := range overlap.AimLines {
		oj.printf("aimed %s", line)
	}
	if cfg.Partitions {
		// The lease verdict is about partitions; without them it has nothing to check.
		lease := leaseVerdict(res.Faults, r.sink.allCalls(), pids, r.started, cfg.AckWait, hookTimeout)
		res.Lease = &lease
		j := r.newJournal("lease")
		for _, viol := range lease.Violations {
			j.printf("%s", viol)
		}
	}
	if err != nil && ctx.Err() == nil {
		r.dumpStacks()
	}
	r.dumpChanges()
	return res
}

// dumpStacks ends every running consumer with SIGQUIT, which makes a Go program write the
// stacks of all its goroutines to its log before it exits: what a job that never ends was
// waiting for. Only after the run failed to converge.
func (r *run) dumpStacks() {
	var dumped []string
	for _, p := range r.consumers() {
		if !p.running() {
			continue
		}
		p.mu.Lock()
		p.dumped = true
		p.mu.Unlock()
		p.stop(syscall.SIGQUIT, 10*time.Second)
		dumped = append(dumped, p.name)
	}
	r.logf("not converged: sent SIGQUIT to %v; their goroutine stacks end their logs in %s", dumped, r.logDir)
}

// setup starts the servers, installs Spiegel, writes the rules and starts the pipeline.
func (r *run) setup(ctx context.Context, res *Result) error {
	var err error
	if r.couch, err = startCouch(ctx, r); err != nil {
		return err
	}
	res.Server = r.couch.describe()
	if note := r.couch.schedulerNote(ctx); note != "" {
		res.Server += "; " + note
	}
	r.logf("CouchDB: %s", res.Server)
	if r.nats, err = startCluster(ctx, r, r.cfg.OutDir); err != nil {
		return err
	}
	r.logf("NATS: three nodes %s", r.nats.URLs())
	if r.sink, err = startSink(r.cfg, r.cfg.OutDir, hookTimeout, slowFor, r.newJournal("sink")); err != nil {
		return err
	}
	res.sink = r.sink
	if err := r.install(ctx); err != nil {
		return err
	}
	r.changes = &streamReader{js: r.nats.js, stream: r.subjects.ChangesStream()}
	if err := r.startPipeline(ctx); err != nil {
		return err
	}
	r.probes = &prober{r: r}
	r.gaps = newGapWatch()
	if err := r.probes.createProbeDBs(ctx); err != nil {
		return err
	}
	r.logf("pipeline ready: %v", procNames)
	return nil
}

// allReady reports whether every product process answers /readyz with 200.
func (r *run) allReady(ctx context.Context) bool {
	for _, p := range r.procs {
		if !p.running() || httpStatus(ctx, p.ready) != 200 {
			return false
		}
	}
	return true
}

// reportProgress logs the writer's progress every 15s (every 60s in runs over 5 minutes).
func (r *run) reportProgress(ctx context.Context, w *writer) {
	every := 15 * time.Second
	if r.cfg.Duration > 5*time.Minute {
		every = time.Minute
	}
	for sleepCtx(ctx, every) == nil {
		done, _, retries, _ := w.stats()
		n := 0
		for _, c := range done {
			n += c
		}
		r.logf("progress: %d writer ops applied (%d retried)", n, retries)
	}
}

// shutdown stops every process (product processes with SIGTERM, whose exit status must be 0),
// then the servers, and checks that none is left; on a passing run it removes what the output
// dir does not need, and on an external CouchDB the run's dbs.
func (r *run) shutdown(res *Result) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, p := range r.procs {
		res.addExits(p)
		wg.Go(func() {
			err, forced := p.stop(syscall.SIGTERM, 30*time.Second)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case forced:
				res.fail("%s did not exit within 30s of SIGTERM (killed)", p.name)
			case err != nil && p.wasDumped():
				// ended by dumpStacks
			case err != nil:
				res.fail("%s exited with %v on SIGTERM; its log ends:\n%s", p.name, err, p.logTail(10))
			}
		})
	}
	wg.Wait()
	for _, p := range r.procs {
		p.links.close()
	}
	res.scanLogs(r)
	if r.nats != nil {
		r.nats.close()
		for _, n := range r.nats.nodes {
			res.addExits(n.proc)
			n.stop(syscall.SIGTERM, 10*time.Second)
		}
	}
	if r.sink != nil {
		r.sink.close()
	}
	if r.couch != nil {
		if r.couch.pouch != nil {
			res.addExits(r.couch.pouch)
			r.couch.pouch.stop(syscall.SIGTERM, 10*time.Second)
		} else {
			r.couch.closeProxies()
			if !r.cfg.Keep {
				r.dropDBs()
			}
		}
	}
	for _, c := range res.Crashes {
		res.fail("CRASH: %s", c)
	}
	if r.cfg.Strict {
		for _, e := range res.StartupExits {
			res.fail("STARTUP EXIT (CHAOS_STRICT): %s", e)
		}
		if v := res.Verdict; v != nil {
			for _, d := range v.DeadLetters {
				if d.Accounted != "" {
					res.fail("DEAD LETTER (CHAOS_STRICT): %s", d)
				}
			}
		}
	}
	r.mu.Lock()
	res.Started = len(r.pids)
	for _, pid := range r.pids {
		if alive(pid) {
			res.fail("process %d is still running", pid)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	r.mu.Unlock()
	for _, j := range r.journals {
		j.close()
	}
	res.Total = r.since()
	res.write(r.out)
	if f, err := os.Create(filepath.Join(r.cfg.OutDir, "summary.txt")); err == nil {
		res.write(f)
		_ = f.Close()
	}
	if r.probes != nil {
		if f, err := os.Create(filepath.Join(r.cfg.OutDir, "probes.tsv")); err == nil {
			r.probes.writeTimes(f)
			_ = f.Close()
		}
	}
	if res.Pass() && !r.cfg.Keep {
		if r.cfg.Name == "short" {
			_ = os.RemoveAll(r.cfg.OutDir)
			return
		}
		// Logs, plan and summary stay; the server stores go.
		_ = os.RemoveAll(filepath.Join(r.cfg.OutDir, "couchdb", "data"))
		for _, n := range []string{"n1", "n2", "n3"} {
			_ = os.RemoveAll(filepath.Join(r.cfg.OutDir, n+"-store"))
			_ = os.RemoveAll(filepath.Join(r.cfg.OutDir, n+"-store.copy"))
		}
	}
}

// dropDBs deletes the run's dbs (the unique prefix) on an external CouchDB.
func (r *run) dropDBs() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var all []string
	if _, err := r.couch.do(ctx, "GET", "/_all_dbs", nil, &all); err != nil {
		return
	}
	for _, db := range all {
		if len(db) > len(r.prefix) && db[:len(r.prefix)] == r.prefix {
			_, _ = r.couch.do(ctx, "DELETE", "/"+db, nil, nil)
		}
	}
}

// workConsumers says, while the work stream holds jobs, where they stand for each consumer:
// delivered and not yet acknowledged (running, or waiting out a nak delay or AckWait), waiting
// to be delivered, redelivered, and the oldest unacknowledged job's subject and deliveries.
func (r *run) workConsumers(ctx context.Context) string {
	st, err := r.nats.js.Stream(ctx, r.subjects.WorkStream())
	if err != nil {
		return ""
	}
	var parts []string
	for _, name := range []string{"replicator", "onchange"} {
		c, err := st.Consumer(ctx, name)
		if err != nil {
			continue
		}
		info, err := c.Info(ctx)
		if err != nil || info.NumAckPending+int(info.NumPending) == 0 {
			continue
		}
		part := fmt.Sprintf("%s: %d unacknowledged, %d undelivered, %d redelivered", name, info.NumAckPending, info.NumPending, info.NumRedelivered)
		if info.AckFloor.Stream > 0 || info.NumAckPending > 0 {
			if m, err := st.GetMsg(ctx, info.AckFloor.Stream+1); err == nil {
				part += fmt.Sprintf(", oldest %s stored %s ago", m.Subject, time.Since(m.Time).Round(time.Second))
			}
		}
		parts = append(parts, part)
	}
	if len(parts) == 0 {
		return ""
	}
	return " — " + strings.Join(parts, "; ")
}
