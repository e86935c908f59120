package worker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// The lost-wakeup rule through wakeup markers (natsjs.Jobs.Offer): a change offered while a db's
// job is pending or running is refused as a duplicate and leaves a marker; after the job is
// settled the runner reads the marker and enqueues the job again for it; the run of that job
// deletes it. A marker is never deleted before a job that covers it is stored.
//
// Handlers only record and signal: every assertion runs on the test's goroutine.

// reasons returns the reasons of the recorded calls of db.
func reasons(rec *recorder, db string) []string {
	var out []string
	for _, c := range rec.all() {
		if c.DB == db {
			out = append(out, c.Reason)
		}
	}
	return out
}

// blockFirst returns a handler that records every call, holds the first one until release is
// closed (signalling running when it starts) and then returns first; later calls return nil.
func blockFirst(rec *recorder, running, release chan struct{}, first error) Handler {
	return func(ctx context.Context, job *Job) error {
		if rec.add(job) > 1 {
			return nil
		}
		close(running)
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return first
	}
}

func waitClosed(t *testing.T, ch chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitFor):
		t.Fatal(what)
	}
}

func (e *env) marker(t *testing.T, db string) uint64 {
	t.Helper()
	m, err := e.jobs.ReadWakeup(t.Context(), group, db)
	require.NoError(t, err)
	return m.Seq
}

// queueWithMarker queues db's job and offers db once more while it waits: the offer is refused
// and leaves a wakeup marker.
func (e *env) queueWithMarker(t *testing.T, db string) {
	t.Helper()
	e.publish(t, db, events.TypeUpdated)
	dedup, err := e.jobs.Offer(t.Context(), group, events.Job{DB: db, Reason: events.TypeUpdated})
	require.NoError(t, err)
	require.True(t, dedup, "the queued job holds the db's slot")
	require.NotZero(t, e.marker(t, db), "the refused offer left a marker")
}

// TestWakeupDuringRunRunsTheJobAgain: a change offered while the job runs makes a second run,
// which deletes the marker.
func TestWakeupDuringRunRunsTheJobAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	running, release := make(chan struct{}), make(chan struct{})
	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), blockFirst(&rec, running, release, nil)))
	e.publish(t, "busy", events.TypeUpdated)
	waitClosed(t, running, "the job did not start")
	dedup, err := e.jobs.Offer(t.Context(), group, events.Job{DB: "busy", Reason: events.TypeUpdated})
	require.NoError(t, err)
	assert.True(t, dedup, "the running job holds the db's slot")
	require.NotZero(t, e.marker(t, "busy"), "the refused offer left a marker")
	close(release)

	require.Eventually(t, func() bool { return rec.count() == 2 && e.marker(t, "busy") == 0 }, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, []string{events.TypeUpdated, events.ReasonWakeup}, reasons(&rec, "busy"))
	holdsFor(t, 300*time.Millisecond, func() bool { return rec.count() == 2 }, "no third run")
}

// TestWakeupWhilePendingRunsOnceMore: a change offered while the job waits briefly in the queue
// is read by that job's run; the marker it left costs one more run (which finds nothing new),
// never a loop: that run covers the marker and deletes it. (This is the price of a job path of
// one API request: a job taken at once does not read the marker when it starts.)
func TestWakeupWhilePendingRunsOnceMore(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	e.queueWithMarker(t, "queued")
	var rec recorder
	var obs results
	cfg := testConfig()
	cfg.Observer = &obs
	cfg.queuedLong = time.Hour // the job counts as taken at once
	start(t, e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error { rec.add(job); return nil }))
	require.Eventually(t, func() bool { return obs.get(ResultOK) == 2 && e.marker(t, "queued") == 0 }, waitFor, tick)
	e.requireDrained(t)
	holdsFor(t, 300*time.Millisecond, func() bool { return rec.count() == 2 && e.streamMsgs(t) == 0 }, "no third run")
	assert.Equal(t, []string{events.TypeUpdated, events.ReasonWakeup}, reasons(&rec, "queued"))
}

// TestWakeupWhileQueuedLongCostsNoRun: a job that waited in the queue (a backlog) reads its db's
// marker before it runs: the marker, left by a change offered while the job waited, is covered by
// that run and deleted after it, with no second run. Behind the initial sync of 10,000 dbs this
// was one run more for nearly every db.
func TestWakeupWhileQueuedLongCostsNoRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	e.queueWithMarker(t, "backlog")
	var rec recorder
	var obs results
	cfg := testConfig()
	cfg.Observer = &obs
	cfg.queuedLong = time.Nanosecond // every job waited long enough
	start(t, e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error { rec.add(job); return nil }))
	require.Eventually(t, func() bool { return obs.get(ResultOK) == 1 && e.marker(t, "backlog") == 0 }, waitFor, tick)
	e.requireDrained(t)
	holdsFor(t, 300*time.Millisecond, func() bool { return rec.count() == 1 && e.streamMsgs(t) == 0 }, "no run for the marker")
}

// TestJobStoredAfterTheMarkerCoversIt: when the second publish of an offer is stored (the running
// job was acked between the refusal and the marker), the stored job carries the marker: its run
// deletes it, and no run follows.
func TestJobStoredAfterTheMarkerCoversIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	dedup, err := e.jobs.MarkAndRetry(t.Context(), group, events.Job{DB: "raced", Reason: events.TypeUpdated})
	require.NoError(t, err)
	require.False(t, dedup, "the slot was free: the second publish is stored")
	require.NotZero(t, e.marker(t, "raced"))
	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error { rec.add(job); return nil }))
	require.Eventually(t, func() bool { return rec.count() == 1 && e.marker(t, "raced") == 0 }, waitFor, tick)
	e.requireDrained(t)
	holdsFor(t, 300*time.Millisecond, func() bool { return rec.count() == 1 }, "no second run")
}

// TestTerminatedJobReadsItsMarker: a job given up (dead letter, Term) while a change came during
// its run runs again for that change.
func TestTerminatedJobReadsItsMarker(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	running, release := make(chan struct{}), make(chan struct{})
	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), blockFirst(&rec, running, release, Permanent(errors.New("rule refused")))))
	e.publish(t, "refused", events.TypeUpdated)
	waitClosed(t, running, "the job did not start")
	_, err := e.jobs.Offer(t.Context(), group, events.Job{DB: "refused", Reason: events.TypeUpdated})
	require.NoError(t, err)
	close(release)

	require.Eventually(t, func() bool { return rec.count() == 2 && e.marker(t, "refused") == 0 }, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, []string{events.TypeUpdated, events.ReasonWakeup}, reasons(&rec, "refused"))
	assert.Equal(t, uint64(1), e.deadLetterCount(t))
}

// TestWakeupCheckFailureRunsTheJobAgain: when the marker cannot be read, the job is enqueued
// again to be safe.
func TestWakeupCheckFailureRunsTheJobAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	running, release := make(chan struct{}), make(chan struct{})
	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), blockFirst(&rec, running, release, nil)))
	e.publish(t, "unknown", events.TypeUpdated)
	waitClosed(t, running, "the job did not start")
	require.NoError(t, e.js.DeleteStream(t.Context(), e.topo.Subjects.WakeupStream()))
	close(release)
	require.Eventually(t, func() bool { return rec.count() >= 2 }, waitFor, tick)
	assert.Equal(t, events.ReasonWakeup, reasons(&rec, "unknown")[1])
}

// The pause after a failed lost-wakeup check does not hold the job's slot: with one slot and a
// pause that outlasts the test, another db's job still runs. (The slots were held through the
// pauses: a burst of failed checks during a NATS leader election stopped a worker's jobs for
// up to 30 s.) The paused job is enqueued again once the pause is over.
func TestWakeupCheckPauseFreesTheSlot(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	running, release := make(chan struct{}), make(chan struct{})
	var rec recorder
	cfg := testConfig()
	cfg.Concurrency = 1
	cfg.wakeupPause = backoff.Policy{Initial: time.Hour, Max: time.Hour}
	start(t, e.newRunner(t, nil, cfg, blockFirst(&rec, running, release, nil)))
	e.publish(t, "first", events.TypeUpdated)
	waitClosed(t, running, "the job did not start")
	require.NoError(t, e.js.DeleteStream(t.Context(), e.topo.Subjects.WakeupStream()))
	close(release)
	e.publish(t, "second", events.TypeUpdated)
	require.Eventually(t, func() bool { return len(reasons(&rec, "second")) == 1 }, waitFor, tick,
		"the second job did not run while the first one's check paused")
	assert.Len(t, reasons(&rec, "first"), 1, "the first job ran again before its pause was over")
}

// A worker that read a marker and then could not enqueue the job again (here: NATS refuses its
// publishes to the work stream, and it is stopped before it gets one through, as a process
// killed or cut off at that moment) leaves the marker where it was. The change it stands for is
// not covered by the db's completion record, so the producer's reconciliation sweep enqueues
// the db (producer TestSweepHealsLostJob: a job lost the same way); that job's run finds the
// marker after it, enqueues one more run for it, and that run deletes it.
func TestMarkerOutlivesAWorkerLostBeforeItsOffer(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, func(o *server.Options) {
		o.Users = []*server.User{
			{Username: "spiegel", Password: "pw"},
			{Username: "cut-off", Password: "pw", Permissions: &server.Permissions{
				Publish: &server.SubjectPermission{Deny: []string{"spiegel.work.>"}},
			}},
		}
	})
	connect := func(user string, opts ...nats.Option) jetstream.JetStream {
		nc, err := nats.Connect(srv.URL(), append(opts, nats.UserInfo(user, "pw"))...)
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		return js
	}
	js := connect("spiegel")
	topo := natsjs.DefaultTopology("")
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	e := &env{srv: srv, js: js, topo: topo, jobs: natsjs.NewJobs(js, topo.Subjects)}

	refused := make(chan struct{}, 1)
	jsA := connect("cut-off", nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) {
			select {
			case refused <- struct{}{}:
			default:
			}
		}
	}))
	running, release := make(chan struct{}), make(chan struct{})
	var recA recorder
	a := start(t, e.newRunner(t, jsA, testConfig(), blockFirst(&recA, running, release, nil)))
	e.publish(t, "cut", events.TypeUpdated)
	waitClosed(t, running, "runner A did not take the job")
	dedup, err := e.jobs.Offer(t.Context(), group, events.Job{DB: "cut", Reason: events.TypeUpdated})
	require.NoError(t, err)
	require.True(t, dedup)
	marker := e.marker(t, "cut")
	require.NotZero(t, marker)
	close(release)
	select {
	case <-refused: // runner A acked the job, read the marker and tried to enqueue the job again
	case <-time.After(waitFor):
		t.Fatal("runner A did not try to enqueue the job again")
	}
	a.stop(t)
	assert.Equal(t, marker, e.marker(t, "cut"), "the marker is still there")
	assert.Equal(t, uint64(0), e.streamMsgs(t), "no job is pending: only the marker stands for the change")

	// The reconciliation sweep's job (any reason): it runs, finds the marker and clears it.
	var recB recorder
	start(t, e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error { recB.add(job); return nil }))
	e.publish(t, "cut", events.ReasonSweep)
	require.Eventually(t, func() bool { return recB.count() >= 1 && e.marker(t, "cut") == 0 }, waitFor, tick,
		"the sweep's job ran and the marker was deleted by a run that covered it")
	e.requireDrained(t)
	assert.Equal(t, 1, recA.count())
}

// TestWakeupWhilePostponedCostsNoRun: changes offered while a job waits for its redelivery (here
// postponed with RetryAfter, as a rule's dirty_after does) are read by that redelivery, which
// reads the marker when it starts: one run, no second one for the marker, which it deletes.
func TestWakeupWhilePostponedCostsNoRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	var obs results
	cfg := testConfig()
	cfg.Observer = &obs
	postponed := make(chan struct{})
	start(t, e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error {
		if rec.add(job) == 1 {
			<-postponed
			return RetryAfter(time.Second, nil)
		}
		return nil
	}))
	e.publish(t, "lazy", events.TypeUpdated)
	require.Eventually(t, func() bool { return rec.count() == 1 }, waitFor, tick)
	close(postponed)
	require.Eventually(t, func() bool { return obs.get(ResultDelayed) == 1 }, waitFor, tick)
	dedup, err := e.jobs.Offer(t.Context(), group, events.Job{DB: "lazy", Reason: events.TypeUpdated})
	require.NoError(t, err)
	require.True(t, dedup, "the postponed job holds the db's slot")
	require.NotZero(t, e.marker(t, "lazy"))

	require.Eventually(t, func() bool { return obs.get(ResultOK) == 1 && e.marker(t, "lazy") == 0 }, waitFor, tick)
	e.requireDrained(t)
	holdsFor(t, 300*time.Millisecond, func() bool { return rec.count() == 2 && e.streamMsgs(t) == 0 }, "no run for the marker")
	assert.Equal(t, 2, rec.all()[1].Attempt)
}
