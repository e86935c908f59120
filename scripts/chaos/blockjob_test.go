package chaos

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A block job is one instance's ruleSlow calls for one db, each starting less than AckWait after
// the job's calls so far ended; the job in progress that has run longest is found, and it is
// long enough once it has run AckWait.
func TestOpenBlockJob(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s, ms := time.Second, time.Millisecond
	call := func(inst, rule, db, id string, from, to time.Duration) sinkCall {
		c := sinkCall{At: start.Add(from), Instance: inst, Rule: rule, DB: db, ID: id, Rev: "1-a"}
		if to > 0 {
			c.End = start.Add(to)
		}
		return c
	}
	var calls []sinkCall
	for i := range 8 { // h/100 on db a: 1s–5s, a call every 500ms, the last still open
		at := s + time.Duration(i)*500*ms
		end := at + 400*ms
		if i == 7 {
			end = 0
		}
		calls = append(calls, call("h/100", slowPath, "a", "x", at, end))
	}
	calls = append(calls,
		call("h/200", slowPath, "b", "y", 0, 2*s),     // db b: 0–2s, answered
		call("h/200", slowPath, "b", "z", 2500*ms, 0), // … and on: 0–now, a call open
		call("h/300", slowPath, "c", "w", 1*s, 3*s),   // db c: another instance took over at 3s
		call("h/100", slowPath, "c", "v", 3*s, 0),     // open, but its job began at 3s
		call("h/200", hookPath, "d", "u", 0, 0),       // not the block rule
		call("", slowPath, "e", "t", 0, 0),            // no instance: not a job anyone holds
		call("h/400", slowPath, "f", "r", 0, 500*ms),  // db f: a job that ended…
		call("h/400", slowPath, "f", "q", 4600*ms, 0), // …and a new one AckWait later
	)
	ackWait := 4 * s

	job, found, ok := openBlockJob(calls, start, start.Add(4*s+600*ms), ackWait, ackWait)
	require.True(t, found)
	assert.True(t, ok, "db b's job has run 4.6s")
	assert.Equal(t, "b", job.DB)
	assert.Equal(t, "h/200", job.Instance)
	assert.Equal(t, time.Duration(0), job.Start)
	assert.Equal(t, 2, job.Calls)
	require.NotNil(t, job.Open)
	assert.Equal(t, "z", job.Open.ID)

	// At 3.9s no job has run AckWait yet: the longest in progress is still named.
	job, found, ok = openBlockJob(calls, start, start.Add(3900*ms), ackWait, ackWait)
	assert.True(t, found)
	assert.False(t, ok)
	assert.Equal(t, "b", job.DB)

	// Without db b: db a's job (1s–now) is the longest once it has run 4s; db f's is new.
	var noB []sinkCall
	for _, c := range calls {
		if c.DB != "b" {
			noB = append(noB, c)
		}
	}
	job, _, ok = openBlockJob(noB, start, start.Add(4900*ms), ackWait, ackWait)
	assert.False(t, ok, "db a's job has run 3.9s")
	assert.Equal(t, "a", job.DB)
	job, _, ok = openBlockJob(noB, start, start.Add(5*s), ackWait, ackWait)
	assert.True(t, ok)
	assert.Equal(t, "a", job.DB)
	assert.Equal(t, 8, job.Calls)

	// A job whose calls are all answered is not in progress, however long it ran.
	_, found, _ = openBlockJob([]sinkCall{call("h/100", slowPath, "a", "x", 0, 9*s)}, start, start.Add(9500*ms), ackWait, ackWait)
	assert.False(t, found)
}

// blockJobs ends a job when another instance calls or when a call starts AckWait or more after
// the job's calls ended; a call inside a longer one extends nothing.
func TestBlockJobsGrouping(t *testing.T) {
	t.Parallel()
	s := time.Second
	tc := func(inst string, from, to time.Duration) timedCall {
		return timedCall{sinkCall: sinkCall{Instance: inst, Rule: slowPath, DB: "a"}, start: from, end: to}
	}
	jobs := blockJobs("a", []timedCall{
		tc("h/1", 0, 10*s),
		tc("h/1", 1*s, 2*s),   // inside the first
		tc("h/1", 13*s, 14*s), // 3s after: the same job
		tc("h/1", 18*s, 19*s), // 4s after: a new one
		tc("h/2", 19*s, 20*s), // another instance
		{sinkCall: sinkCall{Instance: "h/2", Rule: hookPath}, start: 20 * s, end: 30 * s}, // not the block rule
	}, 4*s)
	require.Len(t, jobs, 3)
	assert.Equal(t, [3]time.Duration{0, 14 * s, 3}, [3]time.Duration{jobs[0].Start, jobs[0].End, time.Duration(jobs[0].Calls)})
	assert.Equal(t, [2]time.Duration{18 * s, 19 * s}, [2]time.Duration{jobs[1].Start, jobs[1].End})
	assert.Equal(t, "h/2", jobs[2].Instance)
	assert.Equal(t, 20*s, jobs[2].End)
}

// aimAt waits for a job long enough without the lock, takes the lock, and strikes only if the
// job is still there; otherwise it lets go and waits on. Past its deadline it takes the lock and
// says why it found none, naming the longest job it saw; an ended context returns without it.
func TestAimAt(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	ackWait := 4 * time.Second
	long := blockJob{DB: "a", Instance: "h/1", Start: 0, End: 5 * time.Second, Calls: 7}
	short := blockJob{DB: "b", Instance: "h/2", Start: 0, End: 1500 * ms, Calls: 2}

	t.Run("strikes once the job is still there under the lock", func(t *testing.T) {
		t.Parallel()
		// Looks: not yet, ok (then gone under the lock), ok, ok under the lock.
		answers := []bool{false, true, false, true, true}
		n, locks, unlocks := 0, 0, 0
		find := func() (blockJob, bool, bool) {
			ok := answers[min(n, len(answers)-1)]
			n++
			if ok {
				return long, true, true
			}
			return short, true, false
		}
		job, missed, err := aimAt(t.Context(), time.Second, ms, find, func() { locks++ }, func() { unlocks++ }, ackWait)
		require.NoError(t, err)
		assert.Empty(t, missed)
		assert.Equal(t, "a", job.DB)
		assert.Equal(t, 2, locks)
		assert.Equal(t, 1, unlocks, "the lock is let go when the job was gone, and held on return")
	})

	t.Run("missed: the longest job in progress is named", func(t *testing.T) {
		t.Parallel()
		locks := 0
		find := func() (blockJob, bool, bool) { return short, true, false }
		job, missed, err := aimAt(t.Context(), 30*ms, 5*ms, find, func() { locks++ }, func() { t.Error("unlocked") }, ackWait)
		require.NoError(t, err)
		assert.Equal(t, blockJob{}, job)
		assert.Equal(t, 1, locks, "it strikes anyway, holding the lock")
		assert.Contains(t, missed, "no block job of at least AckWait (4s) was in progress within 30ms of the fault's planned moment")
		assert.Contains(t, missed, "the longest in progress was b by h/2, +0s–+1.5s, 2 calls (1.5s)")
	})

	t.Run("missed: no block-rule call at all", func(t *testing.T) {
		t.Parallel()
		find := func() (blockJob, bool, bool) { return blockJob{}, false, false }
		_, missed, err := aimAt(t.Context(), 10*ms, 5*ms, find, func() {}, func() {}, ackWait)
		require.NoError(t, err)
		assert.Contains(t, missed, "no block-rule call was in progress at all")
	})

	t.Run("context ends", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		find := func() (blockJob, bool, bool) { return short, true, false }
		_, _, err := aimAt(ctx, time.Second, ms, find, func() { t.Error("locked") }, func() {}, ackWait)
		assert.ErrorIs(t, err, context.Canceled)
	})
}

// An aimed fault's record says where it struck: the job's db and instance, how long it had run,
// the call that was open, and the leader before and after; or why it struck without a job.
func TestAimRecordString(t *testing.T) {
	t.Parallel()
	a := &aimRecord{Job: blockJob{DB: "a", Instance: "h/1", Open: &timedCall{sinkCall: sinkCall{ID: "x", Rev: "2-b"}, start: 5 * time.Second}},
		Age: 5200 * time.Millisecond, Before: "n1", After: "n3"}
	assert.Equal(t, "inside the block job of a by h/1, running 5.2s, call x 2-b open since +5s; leader nats-n1 → nats-n3", a.String())
	a = &aimRecord{Missed: "no block job", Before: "n2"}
	assert.Equal(t, "struck without a block job: no block job; leader nats-n2 → none seen", a.String())
}
