package worker

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

func TestShutdownLetsRunningJobsFinish(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	started := make(chan string, 2)
	release := make(chan struct{})
	var ctxErrs atomic.Int32
	r := e.newRunner(t, nil, testConfig(), func(ctx context.Context, job *Job) error {
		started <- job.DB
		<-release
		if ctx.Err() != nil {
			ctxErrs.Add(1)
		}
		return nil
	})
	rr := start(t, r)
	e.publish(t, "one", "")
	e.publish(t, "two", "")
	for range 2 {
		select {
		case <-started:
		case <-time.After(waitFor):
			t.Fatal("handlers did not start")
		}
	}

	rr.cancel()
	require.Eventually(t, func() bool { return e.consumerInfo(t).NumWaiting == 0 }, waitFor, tick,
		"the runner withdraws its pull request")
	e.publish(t, "after-cancel", "")
	require.Never(t, func() bool { return len(rr.done) > 0 }, 300*time.Millisecond, tick,
		"Run returned while jobs were running")
	assert.Equal(t, 2, r.InFlight())
	close(release)
	took := rr.stop(t)
	assert.Less(t, took, testConfig().Grace, "finished within the grace period")

	assert.Zero(t, ctxErrs.Load(), "handler contexts stay alive within the grace period")
	info := e.consumerInfo(t)
	assert.Zero(t, info.NumAckPending, "both jobs were settled")
	assert.Equal(t, uint64(2), info.Delivered.Consumer, "two deliveries, no redelivery")
	assert.Equal(t, uint64(1), e.streamMsgs(t), "both jobs acked; the job published after cancel was not pulled")
	assert.Equal(t, uint64(1), info.NumPending)
}

func TestShutdownNaksJobsPastGrace(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	started := make(chan struct{}, 1)
	cfg := testConfig()
	cfg.Grace = 300 * time.Millisecond
	obs := &results{}
	cfg.Observer = obs
	r := e.newRunner(t, nil, cfg, func(ctx context.Context, _ *Job) error {
		started <- struct{}{}
		<-ctx.Done()
		return nil // even "success" after the cancellation must not be acked
	})
	rr := start(t, r)
	e.publish(t, "stuck", "")
	select {
	case <-started:
	case <-time.After(waitFor):
		t.Fatal("handler did not start")
	}
	took := rr.stop(t)
	assert.GreaterOrEqual(t, took, cfg.Grace)
	assert.Less(t, took, cfg.Grace+abandonAfter, "Run returned once the cancelled handler returned")
	assert.Equal(t, []string{ResultRetry}, obs.sequence())

	assert.Equal(t, uint64(1), e.streamMsgs(t), "the job was not acked")

	// The consumer's AckWait is 60s, longer than waitFor: a runner only gets the job again in
	// time because it was nak'ed.
	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		rec.add(job)
		return nil
	}))
	require.Eventually(t, func() bool { return rec.count() == 1 }, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, 2, rec.all()[0].Attempt)
	assert.Equal(t, "stuck", rec.all()[0].DB)
}

func TestKilledConsumerJobGoesToAnother(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2*time.Second)
	ncA, jsA := e.srv.Connect(t)
	startedA := make(chan struct{}, 1)
	cfgA := testConfig()
	cfgA.Grace = 100 * time.Millisecond
	runnerA := e.newRunner(t, jsA, cfgA, func(ctx context.Context, _ *Job) error {
		startedA <- struct{}{}
		<-ctx.Done() // hangs until the process "dies"
		return ctx.Err()
	})
	rrA := start(t, runnerA)
	e.publish(t, "orphan", "")
	select {
	case <-startedA:
	case <-time.After(waitFor):
		t.Fatal("runner A did not take the job")
	}
	ncA.Close() // the process loses NATS for good: no ack, no nak, no InProgress

	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		rec.add(job)
		return nil
	}))
	require.Eventually(t, func() bool { return rec.count() == 1 }, waitFor, tick, "runner B got the job after AckWait")
	e.requireDrained(t)
	// 2, or more when a loaded machine could not get B's lease renewed in time.
	assert.GreaterOrEqual(t, rec.all()[0].Attempt, 2)
	assert.GreaterOrEqual(t, e.consumerInfo(t).Delivered.Consumer, uint64(2), "delivered to A, then redelivered to B")

	rrA.stop(t) // runner A kept running through the closed connection and still stops cleanly
}

func TestRunnerSurvivesNATSRestart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	r := e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		rec.add(job)
		return nil
	})
	start(t, r)
	e.publish(t, "before", "")
	require.Eventually(t, func() bool { return rec.count() == 1 }, waitFor, tick)

	e.srv.Restart(t)
	require.Eventually(t, func() bool {
		_, err := e.jobs.Publish(t.Context(), group, events.Job{DB: "after"})
		return err == nil
	}, waitFor, 100*time.Millisecond, "publish after restart")
	require.Eventually(t, func() bool { return rec.count() == 2 }, waitFor, tick, "runner works after the restart")
	e.requireDrained(t)
	assert.Equal(t, "after", rec.all()[1].DB)
}

func TestErrorClassification(t *testing.T) {
	t.Parallel()
	cause := errors.New("cause")
	tests := []struct {
		name      string
		err       error
		permanent bool
		delay     time.Duration
		retry     bool
	}{
		{name: "plain", err: cause},
		{name: "permanent", err: Permanent(cause), permanent: true},
		{name: "wrapped permanent", err: errors.Join(errors.New("ctx"), Permanent(cause)), permanent: true},
		{name: "retry after", err: RetryAfter(time.Second, cause), delay: time.Second, retry: true},
		{name: "negative retry after", err: RetryAfter(-time.Second, cause), retry: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.permanent, IsPermanent(tt.err))
			assert.ErrorIs(t, tt.err, cause)
			ra, ok := asRetryAfter(tt.err)
			assert.Equal(t, tt.retry, ok)
			if ok {
				assert.Equal(t, tt.delay, ra.delay)
			}
		})
	}
	assert.NoError(t, Permanent(nil))
	later := RetryAfter(300*time.Millisecond, nil)
	ra, ok := asRetryAfter(later)
	require.True(t, ok)
	assert.NoError(t, ra.err)
	assert.Equal(t, "retry after 300ms", later.Error())
}

func TestRunnerSurvivesConsumerRecreation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	var rec recorder
	start(t, e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		rec.add(job)
		return nil
	}))
	require.Eventually(t, func() bool { return e.consumerInfo(t).NumWaiting > 0 }, waitFor, tick, "runner pulls")

	require.NoError(t, e.js.DeleteConsumer(t.Context(), e.topo.Subjects.WorkStream(), group.ConsumerName()))
	require.NoError(t, natsjs.Ensure(t.Context(), e.js, e.topo))
	e.publish(t, "after-recreate", "")
	require.Eventually(t, func() bool { return rec.count() == 1 }, waitFor, tick)
	e.requireDrained(t)
}

func TestPermanentErrorWithoutDeadLetterStreamIsNotGivenUp(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	require.NoError(t, e.js.DeleteStream(t.Context(), e.topo.Subjects.DeadLetterStream()))
	var rec recorder
	obs := &results{}
	cfg := testConfig()
	cfg.Observer = obs
	start(t, e.newRunner(t, nil, cfg, func(_ context.Context, job *Job) error {
		rec.add(job)
		return Permanent(errors.New("bad rule"))
	}))
	e.publish(t, "doomed", "")

	require.Eventually(t, func() bool { return rec.count() >= 2 }, waitFor, tick,
		"without a dead letter the job is retried, not terminated")
	assert.Equal(t, uint64(1), e.streamMsgs(t))
	assert.Equal(t, ResultRetry, obs.sequence()[0])

	require.NoError(t, natsjs.Ensure(t.Context(), e.js, e.topo))
	e.requireDrained(t)
	assert.Equal(t, "bad rule", e.deadLetter(t, "doomed").Error)
	assert.Equal(t, uint64(1), e.deadLetterCount(t))
}
