package worker

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// The lost-wakeup rule through wakeup markers (natsjs.Jobs.Offer): a change offered while a db's
// job runs is refused as a duplicate and leaves a marker; after the ack the runner finds it and
// enqueues the job again. A change offered while the job was still pending is read by that run:
// the marker is cleared when the run starts, and the job runs once.

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

// TestWakeupDuringRunRunsTheJobAgain: a change offered while the job runs makes a second run.
func TestWakeupDuringRunRunsTheJobAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	running, release := make(chan struct{}), make(chan struct{})
	var rec recorder
	r := e.newRunner(t, nil, testConfig(), func(ctx context.Context, job *Job) error {
		if rec.add(job) == 1 {
			close(running)
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	})
	start(t, r)
	e.publish(t, "busy", events.TypeUpdated)
	<-running
	dedup, err := e.jobs.Offer(t.Context(), group, events.Job{DB: "busy", Reason: events.TypeUpdated})
	require.NoError(t, err)
	assert.True(t, dedup, "the running job holds the db's slot")
	close(release)

	require.Eventually(t, func() bool { return rec.count() == 2 }, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, []string{events.TypeUpdated, events.ReasonWakeup}, reasons(&rec, "busy"))
	set, err := e.jobs.TakeWakeup(t.Context(), group, "busy")
	require.NoError(t, err)
	assert.False(t, set, "the marker was taken")
}

// TestWakeupWhilePendingRunsOnce: a change offered while the job waits in the queue is read by
// that job's run: one run, no second one.
func TestWakeupWhilePendingRunsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	e.publish(t, "queued", events.TypeUpdated)
	dedup, err := e.jobs.Offer(t.Context(), group, events.Job{DB: "queued", Reason: events.TypeUpdated})
	require.NoError(t, err)
	require.True(t, dedup)
	var rec recorder
	var obs results
	cfg := testConfig()
	cfg.Observer = &obs
	start(t, e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error { rec.add(job); return nil }))
	require.Eventually(t, func() bool { return obs.get(ResultOK) == 1 }, waitFor, tick)
	e.requireDrained(t)
	// A second run would be enqueued right after the ack: nothing came within the time a
	// settled job takes to be offered again.
	holdsFor(t, 500*time.Millisecond, func() bool { return rec.count() == 1 && e.streamMsgs(t) == 0 }, "no second run")
	assert.Equal(t, []string{events.TypeUpdated}, reasons(&rec, "queued"))
}

// TestWakeupCheckFailureRunsTheJobAgain: when the marker cannot be read, the job is enqueued
// again to be safe.
func TestWakeupCheckFailureRunsTheJobAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), func(ctx context.Context, job *Job) error {
		if rec.add(job) == 1 {
			require.NoError(t, e.js.DeleteStream(ctx, e.topo.Subjects.WakeupStream()))
		}
		return nil
	}))
	e.publish(t, "unknown", events.TypeUpdated)
	require.Eventually(t, func() bool { return rec.count() >= 2 }, waitFor, tick)
	assert.Equal(t, events.ReasonWakeup, reasons(&rec, "unknown")[1])
}
