package chaos

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// The overlap verdict: no (group, db) ever has two instances acting at once (SPEC §7.2, §7.6).
//
// What is observable: the sink records each webhook call's arrival and the moment it answered
// it (or saw the client give up), and the instance that made it (X-Spiegel-Instance,
// "<hostname>/<pid>": a restarted process is another instance). Every webhook rule of the run
// is an on_change rule, so every call is made by a job of the onchange group, whose lease is
// per db: two calls for one db, whatever their rules, made by different instances and in
// progress at the same moment mean that two instances ran the db's job at once. That is a
// violation, listed with both calls. Calls of one instance may overlap (its rules of a db run
// concurrently within one job).
//
// Tolerance: the sink reads one clock, and takes a call's end before it writes the answer, so
// anything the client does after the answer comes later; overlapTolerance absorbs the clock
// readings themselves.
//
// One overlap is not the instance acting: a SIGSTOPped instance cannot close its connection, so
// a call it sent before it was stopped stays in progress at the sink until the sink answers it
// (up to stallFor during a sink stall), while its lease runs out and a successor starts. When the
// earlier call's process was stopped throughout the overlap, the overlap is the receiver's
// slowness, not two instances acting: it is counted as excused, not failing.
//
// Also reported: the longest stretch of one instance's ruleSlow calls for one db (a long job,
// blockJob), and how many consumer leader changes of the onchange consumer came during such a
// stretch lasting at least AckWait (the jobs the leader changes ran through).
//
// The aimed leader changes (Fault.InBlockJob, blockjob.go) are checked one by one: each must
// have begun inside a job of at least AckWait, of the db and instance it aimed at. A run with
// aimed faults none of which landed so fails, with each one's reason (aimFailures): then the
// verdict above was not exercised in the case it exists for.

// overlapTolerance is how much two calls may overlap before they count as concurrent.
const overlapTolerance = 5 * time.Millisecond

// overlapResult is the overlap verdict of a run.
type overlapResult struct {
	Calls, DBs   int // calls checked, and the dbs they were for
	Unidentified int // calls without X-Spiegel-Instance: not checked
	Excused      []string
	Violations   []string

	Longest       time.Duration // the longest stretch of one instance's ruleSlow calls for one db
	LongestDB     string
	LongStretches int // stretches of at least AckWait
	LeaderChanges int // onchange consumer leader changes (stepdowns, leader kills) that ran
	InLongJobs    int // of them, those that began during a stretch of at least AckWait

	Aimed       int      // aimed leader changes (Fault.InBlockJob) in the plan
	AimSkipped  int      // of them, left out by CHAOS_SKIP_FAULTS
	AimedLanded int      // of them, those that began inside a block job of at least AckWait
	AimLines    []string // each aimed one: where it struck and the leader before and after
	AimMisses   []string // each aimed one that did not land: why
}

// timedCall is a sinkCall on the run's clock, with its process's name.
type timedCall struct {
	sinkCall
	proc       string
	start, end time.Duration
	open       bool // no answer yet: end is the moment the verdict looked
}

func (c timedCall) String() string {
	return fmt.Sprintf("%s (%s) %s %s %s delivery %s +%s–+%s", c.proc, c.Instance, c.Rule, c.ID, c.Rev, c.Delivery, c.start, c.end)
}

// overlapVerdict checks calls (the sink's, any order): per db, no two calls of different
// instances in progress at once. procPIDs maps each process name to the pids of its
// incarnations; records are the run's faults (its SIGSTOPs excuse an overlap, its consumer
// leader changes are counted); started is the run's start and now ends calls still in progress.
func overlapVerdict(calls []sinkCall, procPIDs map[string][]int, records []faultRecord, started, now time.Time,
	ackWait time.Duration) overlapResult {
	var res overlapResult
	owner := map[int]string{}
	for name, pids := range procPIDs {
		for _, pid := range pids {
			owner[pid] = name
		}
	}
	byDB := map[string][]timedCall{}
	for _, c := range calls {
		if c.Instance == "" {
			res.Unidentified++
			continue
		}
		end := c.End
		if end.IsZero() {
			end = now
		}
		proc := owner[pidOfInstance(c.Instance)]
		if proc == "" {
			proc = "unknown process"
		}
		byDB[c.DB] = append(byDB[c.DB], timedCall{sinkCall: c, proc: proc, start: c.At.Sub(started), end: end.Sub(started), open: c.End.IsZero()})
		res.Calls++
	}
	res.DBs = len(byDB)
	dbs := make([]string, 0, len(byDB))
	for db := range byDB {
		dbs = append(dbs, db)
	}
	sort.Strings(dbs)
	var stretches []blockJob
	for _, db := range dbs {
		cs := byDB[db]
		sort.SliceStable(cs, func(i, j int) bool { return cs[i].start < cs[j].start })
		res.checkDB(db, cs, records)
		stretches = append(stretches, res.slowStretches(db, cs, ackWait)...)
	}
	for _, rec := range records {
		if rec.Skipped != "" || rec.Began == 0 || rec.Target != 0 ||
			rec.Kind != FaultStepdownConsumer && rec.Kind != FaultNATSConsumerLdr {
			continue
		}
		res.LeaderChanges++
		for _, s := range stretches {
			if rec.Began >= s.Start && rec.Began <= s.End {
				res.InLongJobs++
				break
			}
		}
	}
	res.aimed(records, byDB, stretches)
	return res
}

// aimed accounts for the aimed leader changes among records: where each struck, and whether it
// began inside a job of at least AckWait (stretches) of the db and instance it aimed at, while
// the call it saw was still open.
func (res *overlapResult) aimed(records []faultRecord, byDB map[string][]timedCall, stretches []blockJob) {
	for _, rec := range records {
		if !rec.InBlockJob {
			continue
		}
		res.Aimed++
		name := fmt.Sprintf("%s %s planned at +%s (plan +%s)", rec.Kind, workConsumers[rec.Target%len(workConsumers)],
			rec.Started, rec.At.Round(time.Millisecond))
		a := rec.Aim
		miss := func(why string) {
			res.AimMisses = append(res.AimMisses, name+": "+why)
			res.AimLines = append(res.AimLines, name+": MISSED: "+why)
		}
		switch {
		case rec.Skipped != "":
			res.AimSkipped++
			miss("not run (" + rec.Skipped + ")")
			continue
		case rec.Began == 0:
			miss(fmt.Sprintf("did not take effect: %v", rec.Err))
			continue
		case a == nil:
			miss("no record of what it aimed at")
			continue
		case a.Missed != "":
			miss(fmt.Sprintf("struck at +%s: %s", rec.Began, a))
			continue
		}
		at := fmt.Sprintf("struck at +%s (waited %s)", rec.Began, (rec.Began - rec.Started).Round(time.Millisecond))
		var in *blockJob
		for i, s := range stretches {
			if s.DB == a.Job.DB && s.Instance == a.Job.Instance && rec.Began >= s.Start && rec.Began <= s.End {
				in = &stretches[i]
				break
			}
		}
		if in == nil {
			miss(fmt.Sprintf("%s %s, but the sink's calls show no job of at least AckWait there at that moment", at, a))
			continue
		}
		res.AimedLanded++
		open := "no call of it open at that moment"
		if o := a.Job.Open; o != nil {
			for _, c := range byDB[a.Job.DB] {
				if c.Instance == o.Instance && c.start == o.start && c.ID == o.ID {
					switch {
					case c.open:
						open = fmt.Sprintf("call %s open then and never answered", c.ID)
					case c.end > rec.Began:
						open = fmt.Sprintf("call %s open then, answered %s later", c.ID, (c.end - rec.Began).Round(time.Millisecond))
					default:
						open = fmt.Sprintf("call %s answered %s before", c.ID, (rec.Began - c.end).Round(time.Millisecond))
					}
				}
			}
		}
		res.AimLines = append(res.AimLines, fmt.Sprintf("%s: %s inside the block job of %s by %s (%s), running %s of its %s; %s; %s",
			name, at, in.DB, in.proc, in.Instance, (rec.Began-in.Start).Round(time.Millisecond), (in.End-in.Start).Round(time.Millisecond),
			open, a.leaders()))
	}
}

// checkDB finds the overlaps among cs, one db's calls sorted by start: each call against the
// calls that started before it and had not ended by its start.
func (res *overlapResult) checkDB(db string, cs []timedCall, records []faultRecord) {
	var open []timedCall
	for _, c := range cs {
		kept := open[:0]
		for _, o := range open {
			if o.end-overlapTolerance > c.start {
				kept = append(kept, o)
			}
		}
		open = kept
		for _, o := range open {
			if o.Instance == c.Instance {
				continue
			}
			from, to := c.start, min(o.end, c.end)
			if to-from <= overlapTolerance {
				continue
			}
			line := fmt.Sprintf("%s: %s and %s in progress at once for %s", db, o, c, (to - from).Round(time.Millisecond))
			if stoppedThroughout(records, o.proc, from, to) {
				res.Excused = append(res.Excused, line+" (the first one's process was SIGSTOPped throughout)")
				continue
			}
			res.Violations = append(res.Violations, line)
		}
		open = append(open, c)
	}
}

// stoppedThroughout reports whether a SIGSTOP fault of proc covered [from, to].
func stoppedThroughout(records []faultRecord, proc string, from, to time.Duration) bool {
	for _, rec := range records {
		if rec.Kind == FaultStopProc && rec.Skipped == "" && rec.Began > 0 && procNames[rec.Target] == proc &&
			rec.Began <= from && to <= rec.Ended+overlapTolerance {
			return true
		}
	}
	return false
}

// slowStretches measures the stretches of cs (one db's calls, by start) of ruleSlow: calls of one
// instance, each starting less than ackWait after the previous one ended (blockJobs). It
// records the longest and returns those lasting at least ackWait.
func (res *overlapResult) slowStretches(db string, cs []timedCall, ackWait time.Duration) []blockJob {
	var out []blockJob
	for _, j := range blockJobs(db, cs, ackWait) {
		if d := j.End - j.Start; d > res.Longest {
			res.Longest, res.LongestDB = d, db
		}
		if j.End-j.Start >= ackWait {
			res.LongStretches++
			out = append(out, j)
		}
	}
	return out
}

// String is the verdict line.
func (o overlapResult) String() string {
	long := "no block-rule calls"
	if o.Longest > 0 {
		long = fmt.Sprintf("longest block-rule job (one instance's calls for %s) %s, %d of at least AckWait; %d of %d onchange consumer leader changes during one",
			strings.TrimSpace(o.LongestDB), o.Longest.Round(100*time.Millisecond), o.LongStretches, o.InLongJobs, o.LeaderChanges)
	}
	return fmt.Sprintf("%d webhook calls for %d dbs checked: no two instances' calls for one db at once; %d calls without X-Spiegel-Instance; "+
		"%d overlaps of a SIGSTOPped instance's call (excused); %s; %d of %d aimed leader changes landed inside a block job of at least AckWait; %d violations",
		o.Calls, o.DBs, o.Unidentified, len(o.Excused), long, o.AimedLanded, o.Aimed, len(o.Violations))
}

// aimFailures is the failure of a run whose aimed leader changes all missed: none began inside a
// block job of at least AckWait, so the overlap verdict never saw the case it exists for. A run
// whose aimed faults were all left out (CHAOS_SKIP_FAULTS) does not fail on it.
func (o overlapResult) aimFailures() []string {
	if o.Aimed == 0 || o.AimedLanded > 0 || o.AimSkipped == o.Aimed {
		return nil
	}
	return []string{fmt.Sprintf("no onchange consumer leader change landed inside a block job of at least AckWait (%d aimed): %s",
		o.Aimed, strings.Join(o.AimMisses, "; "))}
}

// overlapFailures are the calls of two instances for one db in progress at once, and calls the
// verdict could not attribute to an instance.
func (res *Result) overlapFailures() []string {
	o := res.Overlap
	if o == nil {
		return nil
	}
	out := list("two instances at once", o.Violations)
	out = append(out, o.aimFailures()...)
	if o.Unidentified > 0 {
		out = append(out, fmt.Sprintf("overlap verdict: %d webhook calls carry no X-Spiegel-Instance", o.Unidentified))
	}
	return out
}
