package chaos

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"
)

// Result is what a run found; write prints it. A run passes when nothing was recorded with
// fail: duplicates, leftovers of deleted incarnations and retries are reported, not failures.
type Result struct {
	Cfg         Config
	Digest      string
	PlanSummary string
	Server      string

	WriterDone, WriterSkipped map[string]int
	WriterRetries             int
	WriterDBsLost             int // dbs the server lost after acknowledging their creation
	WriterFailed              []string
	Faults                    []faultRecord

	WriterEnd, LastFault, Converged time.Duration // offsets on the run's clock
	Verdict                         *verdict
	Heal                            []classHeal    // time to heal per fault class
	Lease                           *leaseResult   // no side effect after a lease ran out (lease.go)
	Overlap                         *overlapResult // no two instances acting on one db at once (overlap.go)
	Total                           time.Duration

	Crashes      []string // exits by themselves of processes that were ready: failures
	StartupExits []string // exits by themselves before being ready: failures with CHAOS_STRICT=1
	Started      int      // processes the run started
	sink         *sink    // for its counts
	LogFindings  []string
	LogNotes     []string
	// StoreLossNote says what the storage-loss faults left and how they were reported (gaps.go).
	StoreLossNote string

	mu       sync.Mutex
	failures []string
}

// addExits collects p's exits that the run did not cause.
func (res *Result) addExits(p *proc) {
	c, s := p.exits()
	res.Crashes = append(res.Crashes, c...)
	res.StartupExits = append(res.StartupExits, s...)
}

// fail records a failure.
func (res *Result) fail(format string, args ...any) {
	res.mu.Lock()
	defer res.mu.Unlock()
	res.failures = append(res.failures, fmt.Sprintf(format, args...))
}

// Pass reports whether the run passed: no failure recorded and a verdict that converged with
// no order violation at all (there is no exception), no unaccounted dead letter and no writer op
// given up.
func (res *Result) Pass() bool {
	res.mu.Lock()
	defer res.mu.Unlock()
	v := res.Verdict
	return len(res.failures) == 0 && v != nil && v.converged() && len(v.OrderViolations) == 0 &&
		len(v.unaccounted()) == 0 && len(res.WriterFailed) == 0 && len(res.LogFindings) == 0 && len(res.healFailures()) == 0 &&
		len(res.leaseFailures()) == 0 && len(res.overlapFailures()) == 0
}

// replay is the command that runs the same plan again, with the variables that made this run
// differ from its kind's defaults.
func (res *Result) replay() string {
	c := res.Cfg
	def := shortConfig(c.Root)
	cmd := "go test ./scripts/chaos -run TestChaosShort -v (after make build)"
	if c.Name != "short" {
		def, _ = longConfig(c.Root)
		cmd = fmt.Sprintf("make chaos SEED=%d DURATION=%s", c.Seed, c.Duration)
	}
	var env []string
	add := func(differs bool, kv string) {
		if differs {
			env = append(env, kv)
		}
	}
	add(c.DBs != def.DBs, fmt.Sprintf("CHAOS_DBS=%d", c.DBs))
	add(c.Recreate != def.Recreate, fmt.Sprintf("CHAOS_RECREATE=%d", map[bool]int{false: 0, true: 1}[c.Recreate]))
	add(c.QuickRecreatePct != def.QuickRecreatePct, fmt.Sprintf("CHAOS_QUICK_RECREATE=%d", c.QuickRecreatePct))
	add(c.SinkFail != def.SinkFail, fmt.Sprintf("CHAOS_SINK_FAIL=%g", c.SinkFail))
	add(c.SinkStall != def.SinkStall, fmt.Sprintf("CHAOS_SINK_STALL=%g", c.SinkStall))
	add(c.Q != def.Q, fmt.Sprintf("CHAOS_Q=%d", c.Q))
	add(c.Partitions != def.Partitions, fmt.Sprintf("CHAOS_PARTITIONS=%d", map[bool]int{false: 0, true: 1}[c.Partitions]))
	add(c.StoreLoss != def.StoreLoss, fmt.Sprintf("CHAOS_STORE_LOSS=%d", map[bool]int{false: 0, true: 1}[c.StoreLoss]))
	if len(c.SkipFaults) > 0 {
		names := make([]string, 0, len(c.SkipFaults))
		for n := range c.SkipFaults {
			names = append(names, n)
		}
		sort.Strings(names)
		env = append(env, "CHAOS_SKIP_FAULTS="+strings.Join(names, ","))
	}
	if c.CouchURL != "" {
		env = append(env, "CHAOS_COUCHDB_URL=…")
	}
	if c.CouchRestartCmd != "" {
		env = append(env, "CHAOS_COUCHDB_RESTART_CMD=…")
	}
	if c.CouchNodeCmd != "" {
		env = append(env, "CHAOS_COUCHDB_NODE_CMD=…")
	}
	return strings.TrimSpace(strings.Join(env, " ") + " " + cmd)
}

// secretPattern matches the webhook passwords the run makes (hookS3cret-<hex>).
var secretPattern = regexp.MustCompile(`hookS3cret-[0-9a-f]{24}`)

// scanLogs looks through every process log for panics, data races and fatal errors, and for
// any webhook password (which must never be written anywhere but the passwords file); it
// counts PouchDB Server's unhandled promise rejections.
func (res *Result) scanLogs(r *run) {
	files, _ := filepath.Glob(filepath.Join(r.logDir, "*.log"))
	var bytes int
	for _, path := range files {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		bytes += len(b)
		text := string(b)
		name := filepath.Base(path)
		for _, bad := range []string{"panic:", "fatal error:", "WARNING: DATA RACE"} {
			if strings.Contains(text, bad) && !strings.HasPrefix(name, "pouchdb") {
				res.LogFindings = append(res.LogFindings, fmt.Sprintf("%s contains %q", name, bad))
			}
		}
		if n := len(secretPattern.FindAllStringIndex(text, -1)); n > 0 {
			res.LogFindings = append(res.LogFindings, fmt.Sprintf("%s shows a webhook password %d time(s)", name, n))
		}
		if n := strings.Count(text, "UnhandledPromiseRejection"); n > 0 {
			res.LogNotes = append(res.LogNotes, fmt.Sprintf("%s: %d UnhandledPromiseRejection line(s)", name, n))
		}
	}
	res.LogNotes = append(res.LogNotes, fmt.Sprintf("%d log files, %d bytes scanned for panics, races and webhook passwords", len(files), bytes))
}

// write prints the result.
func (res *Result) write(w io.Writer) {
	v := res.Verdict
	verdict := "FAIL"
	if res.Pass() {
		verdict = "PASS"
	}
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	p("")
	p("== chaos %s: %s — SEED %d, plan %s, %s of writes and faults, %d dbs, total %s",
		res.Cfg.Name, verdict, res.Cfg.Seed, res.Digest, res.Cfg.Duration, res.Cfg.DBs, res.Total.Round(time.Second))
	p("plan:        %s", res.PlanSummary)
	recreate := "deleted dbs stay deleted"
	if res.Cfg.Recreate {
		recreate = fmt.Sprintf("deleted dbs are recreated, %d%% within a second", res.Cfg.QuickRecreatePct)
	}
	p("             %s; writer %.0f ops/s in %d lanes; sink fails %.1f%% and stalls %.1f%% outside fault periods",
		recreate, res.Cfg.OpsPerS, res.Cfg.Lanes, 100*res.Cfg.SinkFail, 100*res.Cfg.SinkStall)
	p("server:      %s; NATS: 3-node JetStream cluster, streams with 3 replicas; AckWait %s", res.Server, res.Cfg.AckWait)
	p("writer:      applied %s, skipped %s, %d retried attempts, %d given up", counts(res.WriterDone), counts(res.WriterSkipped), res.WriterRetries, len(res.WriterFailed))
	if res.WriterDBsLost > 0 {
		p("             the server lost %d db(s) after acknowledging their creation (a restart right after it): created again", res.WriterDBsLost)
	}
	ran, skipped := map[string]int{}, map[string]int{}
	failedFaults, skippedFaults := 0, 0
	for _, f := range res.Faults {
		switch {
		case f.Skipped != "":
			skippedFaults++
			skipped[f.Kind.String()+": "+f.Skipped]++
		case f.Err != nil:
			failedFaults++
		default:
			ran[f.Kind.String()]++
		}
	}
	p("faults:      %d run %s; skipped %s; %d did not complete", len(res.Faults)-failedFaults-skippedFaults, counts(ran), counts(skipped), failedFaults)
	if v == nil {
		p("verdict:     none (the run did not get that far)")
	} else {
		p("quiesce:     %s after the last fault ended (+%s), %s after the writer's last op (+%s)",
			(res.Converged - res.LastFault).Round(100*time.Millisecond), res.LastFault.Round(time.Millisecond),
			(res.Converged - res.WriterEnd).Round(100*time.Millisecond), res.WriterEnd.Round(time.Millisecond))
		var heal, slow []string
		for _, c := range res.Heal {
			heal = append(heal, c.String())
			if len(c.Unhealed) > 0 || c.Max > time.Minute {
				slow = append(slow, c.Kind.String())
			}
		}
		p("heal:        per fault class, from its end until a change made during it reached target, webhook and stream:")
		p("             %s", strings.Join(heal, "; "))
		if len(slow) > 0 {
			p("             longer than a minute, or never: %s", strings.Join(slow, ", "))
		}
		p("replication: %d live source dbs, %d docs, %d leaf revisions compared; %d mismatches; %d deleted at the end",
			v.LiveDBs, v.Docs, v.Leaves, len(v.ReplMismatch), v.DeletedDBs)
		p("             leftovers of deleted incarnations: %d docs in %d targets; sources back from deletion: %d; foreign docs: %d",
			v.Leftovers, v.LeftoverTargets, len(v.Resurrected), len(v.Foreign))
		status, byGen, bad := res.sinkStats()
		p("webhook:     %d (db, doc, final rev) expected, %d missing; %d duplicate deliveries; answers %s; 200s by password generation %v; bad bodies %d",
			v.HookExpected, len(v.HookMissing), v.HookDuplicates, counts(status), byGen, len(bad))
		if n := inRecreated(v.HookMissing); n > 0 {
			p("             %d of the %d missing are docs of recreated dbs (incarnation > 0)", n, len(v.HookMissing))
		}
		p("block rule:  %d (db, doc, final rev) of its %d dbs expected, %d missing", v.SlowExpected, min(slowDBs, res.Cfg.DBs), len(v.SlowMissing))
		p("changes:     %d messages, %d (db, doc, final rev) expected, %d missing; %d stored duplicates; feed-order violations %d",
			v.StreamMsgs, v.StreamExpected, len(v.StreamMissing), v.StreamDuplicates, len(v.OrderViolations))
		if v.StreamRereads > 0 {
			p("             read again from its start %d times: it lost messages it had acknowledged (storage loss)", v.StreamRereads)
		}
		if res.StoreLossNote != "" {
			p("storage loss: %s", res.StoreLossNote)
		}
		if n := violationsInRecreated(v.orderViolations()); n > 0 {
			p("             %d of the %d feed-order violations are in recreated dbs (incarnation > 0)", n, len(v.OrderViolations))
		}
		if n := inRecreated(v.StreamMissing); n > 0 {
			p("             %d of the %d missing are docs of recreated dbs (incarnation > 0)", n, len(v.StreamMissing))
		}
		p("mirror:      %d keys of live dbs; %d mismatches", v.MirrorKeys, len(v.MirrorMismatch))
		p("dead letters: %d (%d accounted for); work stream: %d messages left", len(v.DeadLetters), len(v.DeadLetters)-len(v.unaccounted()), v.WorkPending)
		for _, d := range v.DeadLetters {
			if d.Accounted != "" {
				p("             %s", d)
			}
		}
	}
	if res.Lease != nil {
		p("leases:      %s", res.Lease)
	}
	if res.Overlap != nil {
		p("overlap:     %s", res.Overlap)
		for _, line := range res.Overlap.AimLines {
			p("aimed:       %s", line)
		}
	}
	p("processes:   %d started; crashes %d; startup exits %d; all stopped, none left running unless listed below", res.Started, len(res.Crashes), len(res.StartupExits))
	if len(res.StartupExits) > 0 && !res.Cfg.Strict {
		p("DEFECT:      %d process(es) exited while starting, on a transient error of a dependency (SPEC §4.8: never exit on a", len(res.StartupExits))
		p("             transient error); restarted as a supervisor would; not failing the run without CHAOS_STRICT=1:")
		for _, e := range res.StartupExits {
			p("             %s", e)
		}
	}
	for _, n := range res.LogNotes {
		p("logs:        %s", n)
	}
	res.mu.Lock()
	failures := append([]string(nil), res.failures...)
	res.mu.Unlock()
	if v != nil {
		failures = append(failures, list("replication mismatch", v.ReplMismatch)...)
		failures = append(failures, list("foreign source doc", v.Foreign)...)
		failures = append(failures, list("webhook missing", v.HookMissing)...)
		failures = append(failures, list("block rule missing", v.SlowMissing)...)
		failures = append(failures, list("change stream missing", v.StreamMissing)...)
		failures = append(failures, list("feed order", v.orderViolations())...)
		failures = append(failures, list("mirror mismatch", v.MirrorMismatch)...)
		failures = append(failures, list("dead letter", v.unaccounted())...)
		failures = append(failures, list("could not check", v.Errors)...)
		if len(v.Resurrected) > 0 {
			p("note:        sources back from deletion: %v", v.Resurrected)
		}
	}
	failures = append(failures, list("writer op given up", res.WriterFailed)...)
	failures = append(failures, res.healFailures()...)
	failures = append(failures, res.leaseFailures()...)
	failures = append(failures, res.overlapFailures()...)
	failures = append(failures, res.LogFindings...)
	for _, f := range failures {
		p("FAILURE:     %s", f)
	}
	if verdict == "FAIL" {
		p("== FAILED — SEED %d; replay: %s; output kept in %s", res.Cfg.Seed, res.replay(), res.Cfg.OutDir)
	} else {
		p("== replay: %s", res.replay())
	}
}

// sinkStats is filled by the run (the sink is gone when the result is printed).
func (res *Result) sinkStats() (map[string]int, string, []string) {
	if res.sink == nil {
		return nil, "{}", nil
	}
	status, byGen, bad := res.sink.stats()
	gens := make([]int, 0, len(byGen))
	for g := range byGen {
		gens = append(gens, g)
	}
	sort.Ints(gens)
	parts := make([]string, 0, len(gens))
	for _, g := range gens {
		parts = append(parts, fmt.Sprintf("%d:%d", g, byGen[g]))
	}
	return status, "{" + strings.Join(parts, " ") + "}", bad
}

// inRecreated counts the "db doc rev" items whose doc belongs to a recreated db.
func inRecreated(items []string) int {
	n := 0
	for _, it := range items {
		if f := strings.Fields(it); len(f) > 1 && incarnation(f[1]) > 0 {
			n++
		}
	}
	return n
}

// violationsInRecreated counts the order violations ("db: doc (…") of recreated dbs.
func violationsInRecreated(items []string) int {
	n := 0
	for _, it := range items {
		if f := strings.Fields(it); len(f) > 1 && incarnation(f[1]) > 0 {
			n++
		}
	}
	return n
}

// list formats up to 20 items of a finding.
func list(what string, items []string) []string {
	var out []string
	for i, it := range items {
		if i == 20 {
			out = append(out, fmt.Sprintf("%s: … and %d more", what, len(items)-20))
			break
		}
		out = append(out, what+": "+it)
	}
	return out
}

// leaseFailures are the webhook calls made by an instance after its lease ran out, and calls
// the lease verdict could not attribute to a process (it could not check them).
func (res *Result) leaseFailures() []string {
	l := res.Lease
	if l == nil {
		return nil
	}
	out := list("call after the lease ran out", l.Violations)
	if l.Unidentified > 0 {
		out = append(out, fmt.Sprintf("lease verdict: %d webhook calls carry no X-Spiegel-Instance of a process of the run", l.Unidentified))
	}
	return out
}

// healFailures are the probes that never reached a destination (a change lost), and, with a
// HealLimit, the fault classes that took longer than it to heal.
func (res *Result) healFailures() []string {
	var out []string
	for _, c := range res.Heal {
		for _, u := range c.Unhealed {
			out = append(out, fmt.Sprintf("probe of fault class %s not healed: %s", c.Kind, u))
		}
		if res.Cfg.HealLimit > 0 && c.Max > res.Cfg.HealLimit {
			out = append(out, fmt.Sprintf("fault class %s took %s to heal (limit %s)", c.Kind, c.Max.Round(100*time.Millisecond), res.Cfg.HealLimit))
		}
	}
	return out
}
