package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

func TestNewWithoutConsumerIsNotInstalled(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	require.NoError(t, e.js.DeleteConsumer(t.Context(), e.topo.Subjects.WorkStream(), group.ConsumerName()))
	_, err := New(e.js, e.topo.Subjects, testConfig(), func(context.Context, *Job) error { return nil }, testLogger(t))
	require.ErrorIs(t, err, natsjs.ErrNotInstalled)

	_, err = New(e.js, e.topo.Subjects, Config{}, func(context.Context, *Job) error { return nil }, testLogger(t))
	require.Error(t, err, "a config without group")
}

func TestEveryJobRunsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	obs := &results{}
	cfg := testConfig()
	cfg.Observer = obs
	r := e.newRunner(t, nil, cfg, func(ctx context.Context, job *Job) error {
		j, ok := FromContext(ctx)
		if !ok || j != job {
			return Permanent(errors.New("context does not carry the job"))
		}
		rec.add(job)
		return nil
	})
	start(t, r)

	const n = 50
	for i := range n {
		e.publish(t, fmt.Sprintf("db/%02d", i), events.TypeUpdated)
	}
	require.Eventually(t, func() bool { return rec.count() >= n }, waitFor, tick)
	e.requireDrained(t)
	require.Eventually(t, func() bool { return r.InFlight() == 0 }, waitFor, tick)

	perDB := map[string]int{}
	for _, c := range rec.all() {
		perDB[c.DB]++
		assert.Equal(t, events.TypeUpdated, c.Reason)
		assert.Equal(t, 1, c.Attempt)
	}
	assert.Len(t, perDB, n)
	for db, runs := range perDB {
		assert.Equal(t, 1, runs, "db %s", db)
	}
	assert.Equal(t, n, obs.get(ResultOK))
	assert.Zero(t, e.deadLetterCount(t))
}

func TestTransientErrorsRetryWithBackoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	obs := &results{}
	cfg := testConfig()
	cfg.Observer = obs
	cfg.Retry.Initial = 100 * time.Millisecond // attempt 1 → 100ms, attempt 2 → 200ms, no jitter
	r := e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error {
		if rec.add(job) < 3 {
			return errors.New("couchdb unavailable")
		}
		return nil
	})
	start(t, r)
	e.publish(t, "flaky", "")

	require.Eventually(t, func() bool { return rec.count() >= 3 }, waitFor, tick)
	e.requireDrained(t)
	calls := rec.all()
	require.Len(t, calls, 3)
	for i, c := range calls {
		assert.Equal(t, i+1, c.Attempt)
		assert.Equal(t, "flaky", c.DB)
	}
	assert.GreaterOrEqual(t, calls[1].At.Sub(calls[0].At), 100*time.Millisecond)
	assert.GreaterOrEqual(t, calls[2].At.Sub(calls[1].At), 200*time.Millisecond)
	assert.Equal(t, []string{ResultRetry, ResultRetry, ResultOK}, obs.sequence())
}

func TestHandlerPanicIsTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	r := e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		if rec.add(job) == 1 {
			panic("bug")
		}
		return nil
	})
	start(t, r)
	e.publish(t, "panics", "")
	require.Eventually(t, func() bool { return rec.count() >= 2 }, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, 2, rec.all()[1].Attempt)
}

func TestPermanentErrorDeadLettersAndFreesTheSubject(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	obs := &results{}
	cfg := testConfig()
	cfg.Observer = obs
	r := e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error {
		if rec.add(job) == 1 {
			return fmt.Errorf("replicate: %w", Permanent(errors.New("target refused: forbidden")))
		}
		return nil
	})
	start(t, r)
	dedup, err := e.jobs.Publish(t.Context(), group, events.Job{DB: "a/b", Seq: "17-abc"})
	require.NoError(t, err)
	require.False(t, dedup)

	require.Eventually(t, func() bool { return e.deadLetterCount(t) == 1 }, waitFor, tick)
	e.requireDrained(t)
	dl := e.deadLetter(t, "a/b")
	assert.Equal(t, group, dl.Group)
	assert.Equal(t, "a/b", dl.DB)
	assert.Equal(t, "17-abc", dl.Seq)
	assert.Equal(t, "replicate: target refused: forbidden", dl.Error)
	assert.Equal(t, 1, dl.Attempts)
	assert.WithinDuration(t, time.Now(), dl.At, time.Minute)
	assert.Equal(t, 1, obs.get(ResultFailed))
	assert.Equal(t, uint64(1), e.consumerInfo(t).Delivered.Consumer, "a terminated job is not delivered again")

	// The slot is free: a new job for the db is accepted and runs.
	e.publish(t, "a/b", "")
	require.Eventually(t, func() bool { return rec.count() == 2 }, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, 1, rec.all()[1].Attempt, "a new message, not a redelivery")
	assert.Equal(t, uint64(1), e.deadLetterCount(t))
}

func TestRetryAfterDelaysTheJob(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	obs := &results{}
	cfg := testConfig()
	cfg.Observer = obs
	r := e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error {
		if rec.add(job) == 1 {
			return RetryAfter(300*time.Millisecond, nil)
		}
		return nil
	})
	start(t, r)
	e.publish(t, "dirty-after", "")

	require.Eventually(t, func() bool { return rec.count() >= 2 }, waitFor, tick)
	e.requireDrained(t)
	calls := rec.all()
	require.Len(t, calls, 2)
	assert.GreaterOrEqual(t, calls[1].At.Sub(calls[0].At), 300*time.Millisecond)
	assert.Equal(t, 2, calls[1].Attempt)
	// The result is observed after the ack, which drained the queue: wait for it.
	require.Eventually(t, func() bool { return len(obs.sequence()) >= 2 }, waitFor, tick)
	assert.Equal(t, []string{ResultDelayed, ResultOK}, obs.sequence())
}

// Not parallel: with a 1s AckWait, the test must not starve for CPU behind the others.
func TestInProgressKeepsALongJobAlive(t *testing.T) {
	e := newEnv(t, time.Second)
	var entered atomic.Int32
	finished := make(chan struct{})
	r := e.newRunner(t, nil, testConfig(), func(ctx context.Context, _ *Job) error {
		entered.Add(1)
		defer close(finished)
		select {
		case <-time.After(3 * time.Second): // three AckWaits
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	require.Equal(t, time.Second, r.cfg.AckWait, "AckWait is read from the consumer")
	start(t, r)
	e.publish(t, "long", "")

	select {
	case <-finished:
	case <-time.After(waitFor):
		t.Fatal("handler did not finish")
	}
	e.requireDrained(t)
	assert.Equal(t, int32(1), entered.Load(), "the job was not redelivered while it ran")
	assert.Equal(t, uint64(1), e.consumerInfo(t).Delivered.Consumer, "delivered once")
}

func TestConcurrencyIsBoundedAndNothingIsPrefetched(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	const jobs = 20
	var running, maxRunning, done atomic.Int32
	cfg := testConfig()
	cfg.Concurrency = 3
	r := e.newRunner(t, nil, cfg, func(ctx context.Context, _ *Job) error {
		now := running.Add(1)
		defer running.Add(-1)
		for {
			old := maxRunning.Load()
			if now <= old || maxRunning.CompareAndSwap(old, now) {
				break
			}
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		done.Add(1)
		return nil
	})
	for i := range jobs {
		e.publish(t, fmt.Sprintf("slow-%d", i), "")
	}
	start(t, r)

	maxAckPending, maxInFlight := 0, 0
	require.Eventually(t, func() bool {
		maxAckPending = max(maxAckPending, e.consumerInfo(t).NumAckPending)
		maxInFlight = max(maxInFlight, r.InFlight())
		return done.Load() == jobs
	}, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, int32(3), maxRunning.Load(), "never more than Concurrency handlers, and all slots used")
	assert.LessOrEqual(t, maxAckPending, 3, "no job pulled without a free slot")
	assert.LessOrEqual(t, maxInFlight, 3)
}

func TestBadMessages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	r := e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		rec.add(job)
		return nil
	})
	start(t, r)

	// A payload that is not JSON: the subject alone names the db.
	_, err := e.js.Publish(t.Context(), e.topo.Subjects.Work(group, "x/y"), []byte("{not json"))
	require.NoError(t, err)
	// A subject whose token no db name encodes to: given up with a dead letter.
	badSubject := e.topo.Subjects.Prefix + ".work." + string(group) + ".bad~ZZ"
	_, err = e.js.Publish(t.Context(), badSubject, events.Job{DB: "whatever"}.Marshal())
	require.NoError(t, err)

	require.Eventually(t, func() bool { return rec.count() >= 1 && e.deadLetterCount(t) == 1 }, waitFor, tick)
	e.requireDrained(t)
	calls := rec.all()
	require.Len(t, calls, 1, "the bad subject never reaches the handler")
	assert.Equal(t, "x/y", calls[0].DB)
	assert.Empty(t, calls[0].Reason)
	dl := e.deadLetter(t, badSubject)
	assert.Equal(t, group, dl.Group)
	assert.Contains(t, dl.Error, "parse work subject")
}

// A process paused past AckWait (here: its lease clock jumps ahead) finds its job lost on
// resuming: the handler's context ends with ErrLeaseLost, Held turns false, the delivery is
// neither acked nor nak'ed, and JetStream hands the job out again.
func TestLostLeaseStopsTheJobUnsettled(t *testing.T) {
	e := newEnv(t, 2*time.Second)
	var skew atomic.Int64
	rec := &recorder{}
	causes := make(chan error, 2)
	r := e.newRunner(t, nil, testConfig(), func(ctx context.Context, job *Job) error {
		if rec.add(job) > 1 {
			return nil
		}
		skew.Add(int64(4 * time.Second)) // the process "sleeps" through two AckWaits
		assert.False(t, Held(ctx), "a lease past AckWait is not held")
		select {
		case <-ctx.Done():
			causes <- context.Cause(ctx)
		case <-time.After(waitFor):
			causes <- errors.New("the handler's context did not end")
		}
		return nil // a handler that finishes anyway must not get the job acked
	})
	r.now = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	start(t, r)
	e.publish(t, "paused", "")

	select {
	case cause := <-causes:
		assert.ErrorIs(t, cause, ErrLeaseLost)
	case <-time.After(waitFor):
		t.Fatal("handler did not run")
	}
	e.requireDrained(t)
	calls := rec.all()
	require.Len(t, calls, 2, "the job ran again: the lost delivery was not acked")
	// 2, or more when a loaded machine could not get the next delivery's lease renewed in time.
	assert.GreaterOrEqual(t, calls[1].Attempt, 2)
}

// A lease runs AckWait minus a tenth from the pull, then from each confirmed InProgress, counted
// from when it was sent; a confirmation that comes after it ran out does not take it back.
func TestLeaseRunsOutForGood(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newLease(time.Second, now, func() time.Time { return now })
	assert.True(t, l.held())
	now = now.Add(850 * time.Millisecond)
	assert.True(t, l.held(), "within AckWait minus the margin of the pull")
	sent := now
	now = now.Add(40 * time.Millisecond) // the round trip of the InProgress
	assert.True(t, l.renewed(sent), "confirmed while held")
	now = now.Add(850 * time.Millisecond)
	assert.True(t, l.held(), "renewed from when the InProgress was sent")
	now = sent.Add(900 * time.Millisecond)
	assert.False(t, l.held(), "AckWait minus the margin after the last confirmed InProgress was sent")
	assert.False(t, l.renewed(now.Add(-50*time.Millisecond)), "a confirmation after the lease ran out does not take the job back")
	assert.False(t, l.held())

	late := newLease(time.Second, now, func() time.Time { return now })
	sent = now.Add(800 * time.Millisecond)
	now = now.Add(950 * time.Millisecond) // sent in time, answered too late
	assert.False(t, late.renewed(sent), "a confirmation that came after the lease ran out proves nothing")
	assert.False(t, late.held())
	assert.True(t, (&Job{}).Held(), "a job without a lease is held")
}

// TestDrainedAfterABurstOnly: Config.Drained is called once when the last job of a burst (5 jobs
// at once, BurstJobs 4) ends, and never for jobs that run one at a time after it.
func TestDrainedAfterABurstOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var drained atomic.Int32
	cfg := testConfig()
	cfg.Concurrency = 8
	cfg.Drained = func() { drained.Add(1) }
	release := make(chan struct{})
	var rec recorder
	r := e.newRunner(t, nil, cfg, func(ctx context.Context, job *Job) error {
		rec.add(job)
		if job.DB[:5] == "burst" {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	require.Equal(t, 4, r.cfg.BurstJobs, "the default for 8 slots")
	start(t, r)

	for i := range 5 {
		e.publish(t, fmt.Sprintf("burst/%d", i), events.TypeUpdated)
	}
	require.Eventually(t, func() bool { return r.InFlight() == 5 }, waitFor, tick, "five jobs at once")
	assert.Zero(t, drained.Load(), "called while jobs run")
	close(release)
	require.Eventually(t, func() bool { return drained.Load() == 1 }, waitFor, tick, "not called when the burst ended")

	for i := range 6 {
		e.publish(t, fmt.Sprintf("single/%d", i), events.TypeUpdated)
		require.Eventually(t, func() bool { return rec.count() == 6+i && r.InFlight() == 0 }, waitFor, tick)
	}
	holdsFor(t, 300*time.Millisecond, func() bool { return drained.Load() == 1 }, "called again for jobs run one at a time")
}

func TestSettledJobIsLoggedWithItsReasonAndQueueWait(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var out logtest.Buffer
	l := logrus.New()
	l.SetOutput(&out)
	l.SetFormatter(&logrus.JSONFormatter{})
	l.SetLevel(logrus.DebugLevel)
	r, err := New(e.js, e.topo.Subjects, testConfig(), func(context.Context, *Job) error { return nil }, l)
	require.NoError(t, err)

	enqueued := time.Now().UTC().Truncate(time.Millisecond)
	dedup, err := e.jobs.Publish(t.Context(), group, events.Job{DB: "db/swept", Reason: events.ReasonSweep, At: enqueued})
	require.NoError(t, err)
	require.False(t, dedup)
	published := time.Now()
	// The job waits in the queue until the runner starts.
	require.Eventually(t, func() bool { return e.streamMsgs(t) == 1 }, waitFor, tick)
	waited := time.Since(published)
	start(t, r)

	var line map[string]any
	require.Eventually(t, func() bool {
		for _, s := range strings.Split(out.String(), "\n") {
			if strings.Contains(s, `"msg":"job settled"`) {
				return json.Unmarshal([]byte(s), &line) == nil
			}
		}
		return false
	}, waitFor, tick)
	assert.Equal(t, "db/swept", line["db"])
	assert.Equal(t, events.ReasonSweep, line["reason"])
	assert.Equal(t, enqueued.Format(time.RFC3339Nano), line["enqueued_at"])
	assert.Equal(t, ResultOK, line["result"])
	assert.GreaterOrEqual(t, line["queued_ms"], float64(waited.Milliseconds()-1))
	assert.Contains(t, line, "took_ms")
}
