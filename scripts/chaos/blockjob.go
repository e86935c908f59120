package chaos

import (
	"context"
	"fmt"
	"sort"
	"time"
)

// Aimed faults: consumer leader changes that strike inside a long block job.
//
// The overlap verdict (overlap.go) exists for one case: the onchange consumer's leader changes
// (a stepdown, or its node killed) while an instance runs a long job of a db, and the job must
// not be run by a second instance while the first still calls the webhook. Drawn at random
// moments, the leader changes seldom fell inside such a job. An aimed fault (Fault.InBlockJob,
// plan.go) therefore waits, from its planned moment and for at most aimWithin, until the sink
// has a ruleSlow call in progress whose job (blockJob: one instance's ruleSlow calls for one db,
// each starting less than AckWait after the previous ended, as the overlap verdict groups them)
// has run for at least AckWait, and strikes at once, while that call is still open. What it
// found is its aimRecord; the overlap verdict counts those that landed inside a job of at least
// AckWait and fails a run in which none did, saying why (aimFailures).

// aimWithin bounds an aimed fault's wait for a block job: past it, the fault strikes anyway
// and its record says that no job long enough was in progress.
const aimWithin = 40 * time.Second

// aimStep is how often an aimed fault looks at the sink's calls while it waits.
const aimStep = 25 * time.Millisecond

// blockJob is a stretch of one instance's ruleSlow calls for one db, on the run's clock: what
// the sink sees of one job of the block rule (or of jobs of that db that one instance ran back
// to back).
type blockJob struct {
	DB, Instance string
	proc         string        // the instance's process, when known
	Start, End   time.Duration // the first call's arrival; the latest end of its calls (now for a call in progress)
	Calls        int
	Open         *timedCall // the latest of its calls still in progress, if any
}

// age is how long the job had run at t.
func (j blockJob) age(t time.Duration) time.Duration { return t - j.Start }

func (j blockJob) String() string {
	who := j.Instance
	if j.proc != "" {
		who = j.proc + " (" + j.Instance + ")"
	}
	return fmt.Sprintf("%s by %s, +%s–+%s, %d calls", j.DB, who, j.Start.Round(time.Millisecond), j.End.Round(time.Millisecond), j.Calls)
}

// blockJobs groups cs, one db's calls sorted by start, into the jobs of ruleSlow: a job goes on
// while the calls are one instance's and each starts less than gap after the job's calls so far
// ended. Calls of other rules are not part of any.
func blockJobs(db string, cs []timedCall, gap time.Duration) []blockJob {
	var out []blockJob
	var cur *blockJob
	for _, c := range cs {
		if c.Rule != slowPath {
			continue
		}
		if cur != nil && (c.Instance != cur.Instance || c.start-cur.End >= gap) {
			out = append(out, *cur)
			cur = nil
		}
		if cur == nil {
			cur = &blockJob{DB: db, Instance: c.Instance, proc: c.proc, Start: c.start, End: c.end}
		}
		cur.End = max(cur.End, c.end)
		cur.Calls++
		if c.open {
			cc := c
			cur.Open = &cc
		}
	}
	if cur != nil {
		out = append(out, *cur)
	}
	return out
}

// openBlockJob finds, among calls (the sink's ruleSlow calls, any order), the job in progress
// at now that has run longest: a job whose latest call is still open. ok says whether it has
// run at least minAge; found whether any job was in progress at all.
func openBlockJob(calls []sinkCall, started, now time.Time, gap, minAge time.Duration) (job blockJob, found, ok bool) {
	byDB := map[string][]timedCall{}
	for _, c := range calls {
		if c.Rule != slowPath || c.Instance == "" {
			continue
		}
		tc := timedCall{sinkCall: c, start: c.At.Sub(started), end: c.End.Sub(started), open: c.End.IsZero()}
		if tc.open {
			tc.end = now.Sub(started)
		}
		byDB[c.DB] = append(byDB[c.DB], tc)
	}
	dbs := make([]string, 0, len(byDB))
	for db := range byDB {
		dbs = append(dbs, db)
	}
	sort.Strings(dbs)
	t := now.Sub(started)
	for _, db := range dbs {
		cs := byDB[db]
		sort.SliceStable(cs, func(i, j int) bool { return cs[i].start < cs[j].start })
		for _, j := range blockJobs(db, cs, gap) {
			if j.Open != nil && (!found || j.age(t) > job.age(t)) {
				job, found = j, true
			}
		}
	}
	return job, found, found && job.age(t) >= minAge
}

// aimRecord is what an aimed fault found when it struck: the job it struck in (or why there
// was none), and the consumer's leader before and after.
type aimRecord struct {
	Job    blockJob      // the job in progress when it struck
	Age    time.Duration // how long the job had run when the fault took effect
	Missed string        // why it struck without a job of at least AckWait in progress
	Before string        // the consumer's leader before the fault (server name)
	After  string        // and after it (empty: none seen)
}

func (a *aimRecord) String() string {
	if a == nil {
		return ""
	}
	leaders := a.leaders()
	if a.Missed != "" {
		return fmt.Sprintf("struck without a block job: %s; %s", a.Missed, leaders)
	}
	call := ""
	if a.Job.Open != nil {
		call = fmt.Sprintf(", call %s %s open since +%s", a.Job.Open.ID, a.Job.Open.Rev, a.Job.Open.start.Round(time.Millisecond))
	}
	return fmt.Sprintf("inside the block job of %s by %s, running %s%s; %s",
		a.Job.DB, a.Job.Instance, a.Age.Round(time.Millisecond), call, leaders)
}

// leaders says the consumer's leader before and after the fault.
func (a *aimRecord) leaders() string {
	if a.After == "" {
		return fmt.Sprintf("leader nats-%s → none seen", a.Before)
	}
	return fmt.Sprintf("leader nats-%s → nats-%s", a.Before, a.After)
}

// aimAt waits, for at most within, until find reports a job long enough (ok), then takes lock
// and looks again: if the job is still there it returns it holding the lock; if not, it lets go
// and waits on. Past within it takes the lock anyway and returns the longest job it saw in
// progress, and why it found none (missed). The lock (the faults' one on NATS) is not held while
// it waits, so that other NATS faults run meanwhile. An error means ctx ended; the lock is not
// held then.
func aimAt(ctx context.Context, within, step time.Duration, find func() (job blockJob, found, ok bool), lock, unlock func(),
	minAge time.Duration) (job blockJob, missed string, err error) {
	deadline := time.Now().Add(within)
	var longest blockJob
	var seen bool
	look := func() bool {
		j, found, ok := find()
		if found && (!seen || j.age(j.End) > longest.age(longest.End)) {
			longest, seen = j, true
		}
		if ok {
			job = j
		}
		return ok
	}
	for {
		werr := waitUntil(ctx, max(time.Until(deadline), 0), step, "a block job of at least "+minAge.String(), look)
		if ctx.Err() != nil {
			return job, "", ctx.Err()
		}
		lock()
		if werr != nil {
			missed = fmt.Sprintf("no block job of at least AckWait (%s) was in progress within %s of the fault's planned moment", minAge, within)
			if seen {
				missed += fmt.Sprintf("; the longest in progress was %s (%s)", longest, longest.age(longest.End).Round(time.Millisecond))
			} else {
				missed += "; no block-rule call was in progress at all"
			}
			return blockJob{}, missed, nil
		}
		if look() {
			return job, "", nil
		}
		unlock()
	}
}
