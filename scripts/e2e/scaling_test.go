package e2e

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// BenchmarkScaling measures how the consumers scale out: the jobs per second a group of k
// consumer processes of one kind (replicator or onchange) drains from a fixed backlog, for each
// k, on the same CouchDB. The backlog is one job per user db: N dbs of 10 docs are loaded once;
// for each run a fresh NATS and spiegel db get one rule of the group (a pattern replicator rule
// into a fresh target, or an on_change rule calling a local webhook per change, under a rule id
// of its own so that no checkpoint of an earlier run applies), the producer enqueues every db
// and is stopped, and only then the k processes start, talking to CouchDB directly. The other
// group has no rule and no process. So the figure is the consumer group's throughput, not the
// writer's or the producer's.
//
// Per run it records the progress of the backlog (polled every 50 ms from the JetStream
// consumer), the drain time, the CPU time of each process, of the CouchDB server
// (BENCH_SERVER_PID; and its CPU in the 2 s before the run, which other clients of a shared
// server cost it), of the bench process (embedded NATS, webhook sink) and of the whole
// machine (/proc/stat), and the load average. Tunables: BENCH_DBS (100), BENCH_SCALING_PROCS
// (1,2,4), BENCH_SCALING_GROUPS (replicator,onchange), BENCH_SCALING_CONCURRENCY
// (SPIEGEL_CONCURRENCY of each process; the product's default when unset), BENCH_SCALING_ROUNDS
// (1: sweeps over the process counts, every other one in reverse order), BENCH_SERVER_PID,
// BENCH_BIN_DIR, BENCH_REPORT_DIR (one record per run for the end-to-end report).
func BenchmarkScaling(b *testing.B) {
	root := repoRoot(b, "producer", "replicator", "onchange")
	cs := couchtest.Get(b)
	cfg := scalingFromEnv(b)
	up := cs.NewUpdatesProxy(b, couchtest.CoalesceWindow(500*time.Millisecond))
	prefix := couchtest.UniqueName(b, "bench_scaling_") + "_"
	cs.CleanupPrefix(b, prefix)
	users := loadScalingDBs(b, up.Server(), prefix, cfg.dbs, scalingDocsPerDB)
	var results []benchdata.ScalingRun
	for i := range b.N {
		results = results[:0]
		for round := range cfg.rounds {
			for _, group := range cfg.groups {
				// Every other round goes down from the most processes, so that a machine whose load
				// drifts during the sweep does not favour one end of it.
				ks := slices.Clone(cfg.procs)
				if round%2 == 1 {
					slices.Reverse(ks)
				}
				for _, k := range ks {
					r := runScaling(b, root, cs, up, cfg, scalingRun{prefix: prefix, users: users, group: group, procs: k, round: round, iteration: i})
					b.Logf("round %d, %s ×%d: %d jobs drained in %.2f s, %.1f jobs/s (10 %%→90 %%), %.1f docs/s, server CPU %s, processes %v CPU s, machine %.0f %% busy of %d cores, load %s → %s",
						round, group, k, r.Jobs, r.DrainS, r.JobsPerSec(), r.DocsPerSec(), serverCores(r), r.ProcCPUS, 100*r.MachineBusy, r.Cores, r.LoadAvgStart, r.LoadAvgEnd)
					results = append(results, r)
				}
			}
		}
	}
	for _, r := range results {
		if r.Round == 0 {
			b.ReportMetric(r.JobsPerSec(), fmt.Sprintf("%s-x%d-jobs/s", r.Group, r.Procs))
		}
	}
	if dir := os.Getenv("BENCH_REPORT_DIR"); dir != "" {
		for _, r := range results {
			if err := benchdata.WriteScalingFile(filepath.Join(dir, benchdata.ScalingFileName(r.Group, r.Procs, r.DBs, r.Round)), r); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// scalingDocsPerDB is the docs each user db holds, hence each job carries.
const scalingDocsPerDB = 10

type scalingConfig struct {
	dbs         int
	procs       []int
	groups      []string // replicator, onchange
	concurrency int      // 0: the product's default
	rounds      int      // sweeps over procs
	serverPID   int
}

func scalingFromEnv(b *testing.B) scalingConfig {
	c := scalingConfig{dbs: 100, procs: []int{1, 2, 4}, groups: []string{"replicator", "onchange"}, rounds: 1}
	if v := os.Getenv("BENCH_DBS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 10 {
			b.Fatalf("BENCH_DBS=%q: want a number of at least 10", v)
		}
		c.dbs = n
	}
	if v := os.Getenv("BENCH_SCALING_PROCS"); v != "" {
		c.procs = nil
		for _, f := range strings.Split(v, ",") {
			k, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || k < 1 || k > 64 {
				b.Fatalf("BENCH_SCALING_PROCS=%q: want process counts from 1 to 64, comma-separated, such as 1,2,4", v)
			}
			c.procs = append(c.procs, k)
		}
	}
	if v := os.Getenv("BENCH_SCALING_GROUPS"); v != "" {
		c.groups = nil
		for _, g := range strings.Split(v, ",") {
			g = strings.TrimSpace(g)
			if g != "replicator" && g != "onchange" {
				b.Fatalf("BENCH_SCALING_GROUPS=%q: want replicator, onchange or both, comma-separated", v)
			}
			c.groups = append(c.groups, g)
		}
	}
	if v := os.Getenv("BENCH_SCALING_CONCURRENCY"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			b.Fatalf("BENCH_SCALING_CONCURRENCY=%q: want the jobs one process runs at once, at least 1", v)
		}
		c.concurrency = n
	}
	if v := os.Getenv("BENCH_SCALING_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 20 {
			b.Fatalf("BENCH_SCALING_ROUNDS=%q: want the sweeps over the process counts, from 1 to 20", v)
		}
		c.rounds = n
	}
	if v := os.Getenv("BENCH_SERVER_PID"); v != "" {
		pid, err := strconv.Atoi(v)
		if err != nil || pid <= 0 {
			b.Fatalf("BENCH_SERVER_PID=%q: want the pid of the CouchDB server's process", v)
		}
		c.serverPID = pid
	}
	return c
}

// loadScalingDBs creates n user dbs of docs docs each, with doc ids unique across dbs (they all
// meet in one target and at one webhook), and returns their names.
func loadScalingDBs(b *testing.B, writer *couchtest.Server, prefix string, n, docs int) []string {
	b.Helper()
	users := make([]string, n)
	for i := range users {
		users[i] = fmt.Sprintf("%su%05d", prefix, i)
		writer.CreateDB(b, users[i])
		batch := make([]map[string]any, docs)
		for j := range batch {
			batch[j] = map[string]any{"_id": fmt.Sprintf("s%05d_%03d", i, j), "n": j}
		}
		if err := writer.Do(b, http.MethodPost, "/"+couchtest.PathDB(users[i])+"/_bulk_docs", map[string]any{"docs": batch}, nil); err != nil {
			b.Fatalf("load %s: %v", users[i], err)
		}
	}
	return users
}

// scalingRun names one run: a group, a number of processes, the sweep (round) and the
// benchmark's iteration (b.N) it belongs to.
type scalingRun struct {
	prefix           string
	users            []string
	group            string
	procs            int
	round, iteration int
}

// runScaling builds the backlog of one run with the producer alone, stops it, and measures k
// processes of the group draining it.
func runScaling(b *testing.B, root string, cs *couchtest.Server, up *couchtest.UpdatesProxy, cfg scalingConfig, sr scalingRun) benchdata.ScalingRun {
	b.Helper()
	binDir := cmp.Or(os.Getenv("BENCH_BIN_DIR"), filepath.Join(root, "bin"))
	bin := func(name string) string { return filepath.Join(binDir, name) }
	// Names of this run start with the bench's prefix and a letter other than the users' "u", so
	// the pattern rule does not match them.
	runPrefix := fmt.Sprintf("%s%s%d_%d_%d_", sr.prefix, sr.group[:1], sr.procs, sr.round, sr.iteration)
	spiegelDB, target := runPrefix+"spiegel", runPrefix+"target"
	ns := natstest.Start(b)
	defer ns.Stop()
	nc, js := ns.Connect(b)
	defer nc.Close()
	env := func(couchURL string, extra ...string) []string {
		return baseEnv(append([]string{
			"SPIEGEL_COUCHDB_URL=" + couchURL,
			"SPIEGEL_DB_NAME=" + spiegelDB,
			"SPIEGEL_NATS_URL=" + ns.URL(),
			"SPIEGEL_LOG_LEVEL=" + cmp.Or(os.Getenv("BENCH_LOG_LEVEL"), "warn"),
		}, extra...)...)
	}
	if out, code := runCmd(b, bin("producer"), env(pipelineURL(cs, up)), "install"); code != 0 {
		b.Fatalf("producer install:\n%s", out)
	}
	sink := newLatencySink(b)
	defer sink.Close()
	pattern := "^" + sr.prefix + "u"
	ruleID := fmt.Sprintf("scaling_%s_%d_%d_%d", sr.group, sr.procs, sr.round, sr.iteration) // on_change checkpoints are per rule id
	// The backlog: the producer enqueues every user db for the rule, put once it runs; it stops
	// before any consumer starts.
	producerAddr := freeAddr(b)
	// The new rule alone enqueues the dbs: the feed starts from now and the reconciliation sweep
	// is off. The feed's replay of the dbs' loading, or the sweep at start, would enqueue them a
	// second time while their jobs wait (a wakeup marker each), and each job would run twice.
	producer := startProc(b, "producer", bin("producer"), producerAddr,
		env(pipelineURL(cs, up), "SPIEGEL_HTTP_ADDR="+producerAddr, "SPIEGEL_START=now", "SPIEGEL_SWEEP_INTERVAL=0"))
	waitFor(b, 30*time.Second, "producer ready", []*proc{producer}, func() bool { code, _ := producer.get("/readyz"); return code == http.StatusOK })
	writer := up.Server()
	if sr.group == "replicator" {
		cs.CreateDB(b, target)
		writer.Put(b, spiegelDB, ruleID, map[string]any{"type": "replicator", "db_name": pattern, "source": "$db_name", "target": target})
	} else {
		writer.Put(b, spiegelDB, ruleID, map[string]any{"type": "on_change", "db_name": pattern, "url": sink.URL + "/hook",
			"params": map[string]any{"id": "$change.id"}})
	}

	ctx := b.Context()
	cons, err := js.Consumer(ctx, events.NewSubjects("").WorkStream(), sr.group)
	if err != nil {
		b.Fatalf("consumer %s of the work stream: %v", sr.group, err)
	}
	jobs := func() (pending, inFlight int) {
		ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		ci, err := cons.Info(ictx)
		if err != nil {
			return -1, -1
		}
		return int(ci.NumPending), ci.NumAckPending
	}
	waitFor(b, 5*time.Minute, fmt.Sprintf("%s ×%d: backlog of %d jobs", sr.group, sr.procs, len(sr.users)), []*proc{producer}, func() bool {
		p, _ := jobs()
		return p >= len(sr.users)
	})
	if err := producer.stop(30 * time.Second); err != nil {
		b.Fatalf("stop the producer: %v", err)
	}
	backlog, _ := jobs()

	res := benchdata.ScalingRun{Group: sr.group, Procs: sr.procs, Round: sr.round, Concurrency: cfg.concurrency, Server: serverName(cs),
		DBs: len(sr.users), DocsPerDB: scalingDocsPerDB, Jobs: backlog, Cores: runtime.NumCPU(), ServerCPUS: -1}
	res.LoadAvgStart = loadAvg()
	if before := cpuOf(cfg.serverPID); before >= 0 { // the shared server's load from other clients
		t0 := time.Now()
		time.Sleep(2 * time.Second)
		if after := cpuOf(cfg.serverPID); after >= before {
			res.ServerBeforeCores = (after - before) / time.Since(t0).Seconds()
		}
	}
	serverStart, benchStart, machineStart := cpuOf(cfg.serverPID), cpuOf(os.Getpid()), machineCPU()
	extra := []string{}
	if cfg.concurrency > 0 {
		extra = append(extra, "SPIEGEL_CONCURRENCY="+strconv.Itoa(cfg.concurrency))
	}
	started := time.Now()
	res.Started = started
	var procs []*proc
	for i := range sr.procs {
		addr := freeAddr(b)
		procs = append(procs, startProc(b, fmt.Sprintf("%s-%d", sr.group, i+1), bin(sr.group), addr,
			env(cs.URL, append(extra, "SPIEGEL_HTTP_ADDR="+addr)...)))
	}
	var drained bool
	deadline := started.Add(10 * time.Minute)
	for !drained {
		if time.Now().After(deadline) {
			b.Fatalf("%s ×%d: the backlog of %d jobs was not drained within 10 minutes", sr.group, sr.procs, backlog)
		}
		for _, p := range procs {
			if !p.running() {
				b.Fatalf("%s exited (%v) while draining the backlog", p.name, p.err)
			}
		}
		pending, inFlight := jobs()
		if pending < 0 { // JetStream did not answer: poll again
			time.Sleep(50 * time.Millisecond)
			continue
		}
		res.Progress = append(res.Progress, benchdata.Progress{AtS: time.Since(started).Seconds(), Done: backlog - pending - inFlight})
		drained = pending == 0 && inFlight == 0
		if !drained {
			time.Sleep(50 * time.Millisecond)
		}
	}
	res.DrainS = time.Since(started).Seconds()
	for _, p := range procs {
		res.ProcCPUS = append(res.ProcCPUS, cpuOf(p.cmd.Process.Pid))
	}
	if cfg.serverPID > 0 && serverStart >= 0 {
		res.ServerCPUS = cpuOf(cfg.serverPID) - serverStart
	}
	res.BenchCPUS = cpuOf(os.Getpid()) - benchStart
	res.MachineBusy = machineStart.busyUntil(machineCPU())
	res.LoadAvgEnd = loadAvg()
	res.JobsByResult = map[string]int{}
	for _, p := range procs {
		n := 0
		for series, v := range healthtest.Scrape(b, p.addr) {
			if rest, ok := strings.CutPrefix(series, "spiegel_jobs_total{"); ok {
				n += int(v)
				_, result, _ := strings.Cut(rest, `result="`)
				result, _, _ = strings.Cut(result, `"`)
				res.JobsByResult[result] += int(v)
			}
		}
		res.JobsByProc = append(res.JobsByProc, n)
		res.JobsRun += n
	}
	// A job is acknowledged after its docs arrived: they are all there now, unless a job failed.
	want := len(sr.users) * scalingDocsPerDB
	delivered := func() int {
		if sr.group == "replicator" {
			return docCount(b, cs, target)
		}
		return sink.distinct()
	}
	for end := time.Now().Add(30 * time.Second); delivered() < want && time.Now().Before(end); {
		time.Sleep(100 * time.Millisecond)
	}
	res.Delivered = delivered()
	if res.JobsRun != res.Jobs {
		b.Logf("%s ×%d: %d runs for a backlog of %d jobs (%v)", sr.group, sr.procs, res.JobsRun, res.Jobs, res.JobsByResult)
	}
	if res.Delivered < want {
		b.Logf("%s ×%d: %d of %d docs delivered after the backlog drained", sr.group, sr.procs, res.Delivered, want)
	}
	for _, p := range procs {
		_ = p.stop(25 * time.Second)
	}
	if sr.group == "replicator" { // the target's docs are no longer needed; free the server's files
		_ = cs.Do(b, http.MethodDelete, "/"+couchtest.PathDB(target), nil, nil)
	}
	return res
}

// cpuOf returns a process's CPU time (user + system) in seconds; -1 when it cannot be read or
// pid is 0.
func cpuOf(pid int) float64 {
	if pid <= 0 {
		return -1
	}
	st, err := readProc(pid, 0)
	if err != nil {
		return -1
	}
	return st.CPUSeconds
}

// cpuTimes are the machine's busy and total CPU ticks so far, from the first line of
// /proc/stat (all cores): busy is every field but idle and iowait (guest time is already in
// user); both 0 when unreadable.
type cpuTimes struct{ busy, total uint64 }

func machineCPU() cpuTimes {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	return parseCPULine(line)
}

func parseCPULine(line string) cpuTimes {
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuTimes{}
	}
	var t cpuTimes
	for i, v := range f[1:9] { // user nice system idle iowait irq softirq steal
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return cpuTimes{}
		}
		t.total += n
		if i != 3 && i != 4 {
			t.busy += n
		}
	}
	return t
}

// busyUntil returns the fraction of the CPU time between t and later that was busy (-1 when
// unknown).
func (t cpuTimes) busyUntil(later cpuTimes) float64 {
	if t.total == 0 || later.total <= t.total {
		return -1
	}
	return float64(later.busy-t.busy) / float64(later.total-t.total)
}

func TestMachineCPU(t *testing.T) {
	t.Parallel()
	a := parseCPULine("cpu  100 50 30 800 20 0 0 0 0 0")
	assert.Equal(t, cpuTimes{busy: 180, total: 1000}, a)
	b := parseCPULine("cpu  200 50 80 850 20 0 0 0 0 0")
	assert.InDelta(t, 0.75, a.busyUntil(b), 1e-9, "150 of 200 ticks busy")
	assert.Equal(t, -1.0, cpuTimes{}.busyUntil(b))
	assert.Equal(t, cpuTimes{}, parseCPULine("cpu0 1 2 3"))
	assert.Positive(t, machineCPU().total)
}

// serverCores renders the server's CPU over a run in cores.
func serverCores(r benchdata.ScalingRun) string {
	if r.ServerCPUS < 0 {
		return "unknown"
	}
	return fmt.Sprintf("%.2f cores", r.CoresOf(r.ServerCPUS))
}
