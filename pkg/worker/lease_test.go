package worker

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

// sideEffects is the one ordered record of the side effects of several runners, as a webhook
// that knows which instance made each call would keep it.
type sideEffects struct {
	mu      sync.Mutex
	entries []effect
}

type effect struct {
	by string
	at time.Time
}

func (s *sideEffects) add(by string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.entries = append(s.entries, effect{by: by, at: time.Now()})
}

func (s *sideEffects) all() []effect {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]effect(nil), s.entries...)
}

func (s *sideEffects) count(by string) int {
	n := 0
	for _, e := range s.all() {
		if e.by == by {
			n++
		}
	}
	return n
}

// A consumer whose NATS connection freezes in the middle of a long job (a partition: no byte
// moves, no connection closes) can no longer get a renewal of its lease confirmed. Its handler's
// context ends with ErrLeaseLost, and Held turns false, before AckWait has passed since the last
// renewal the server confirmed, so it stops its side effects before JetStream hands the job to
// another consumer; it leaves the job unsettled, and the other consumer runs it to the end.
// (An InProgress that merely left the client, as the first release counted it, kept the frozen
// consumer acting for as long as the freeze lasted.)
//
// Not parallel: the lease has a margin of AckWait/10; a starved test could blur the order.
func TestFrozenConnectionStopsTheJobBeforeItIsRedelivered(t *testing.T) {
	const ackWait = 3 * time.Second
	e := newEnv(t, ackWait)
	proxy := e.srv.NewProxy(t)
	ncA, err := natsjs.Connect(t.Context(), natsjs.Options{URLs: proxy.URL(), Name: "frozen", NoReconnectBuffer: true}, testLogger(t))
	require.NoError(t, err)
	t.Cleanup(ncA.Close)
	jsA, err := jetstream.New(ncA)
	require.NoError(t, err)

	var effects sideEffects
	type stopped struct {
		cause   error
		renewed time.Time // when the last InProgress the server confirmed was sent
		at      time.Time
	}
	started := make(chan *Job, 1)
	stops := make(chan stopped, 1)
	a := e.newRunner(t, jsA, testConfig(), func(ctx context.Context, job *Job) error {
		started <- job
		for Held(ctx) {
			effects.add("a") // a webhook call, a publish, a checkpoint write
			select {
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
		renewed, _ := job.lease.renewedAt()
		stops <- stopped{cause: context.Cause(ctx), renewed: renewed, at: time.Now()}
		effects.add("a stopped")
		return nil // a handler that returns anyway must not get its job acked
	})
	start(t, a)
	e.publish(t, "long", events.TypeUpdated)
	var job *Job
	select {
	case job = <-started:
	case <-time.After(waitFor):
		t.Fatal("runner A did not take the job")
	}
	pulled, _ := job.lease.renewedAt()
	require.Eventually(t, func() bool {
		from, _ := job.lease.renewedAt()
		return from.After(pulled)
	}, waitFor, tick, "runner A's lease was renewed by a confirmed InProgress")

	proxy.Freeze()
	var rec recorder
	b := e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		rec.add(job)
		effects.add("b")
		return nil
	})
	start(t, b)

	var stop stopped
	select {
	case stop = <-stops:
	case <-time.After(waitFor):
		t.Fatal("runner A's handler went on after its connection froze")
	}
	assert.ErrorIs(t, stop.cause, ErrLeaseLost)
	assert.False(t, job.Held())
	assert.True(t, stop.at.Before(stop.renewed.Add(ackWait)),
		"runner A stopped %s after its last confirmed renewal, AckWait is %s", stop.at.Sub(stop.renewed), ackWait)

	require.Eventually(t, func() bool { return rec.count() == 1 }, waitFor, tick, "runner B got the job")
	e.requireDrained(t)
	// Runner A's delivery was left unsettled, so runner B got a redelivery. Not necessarily the
	// second: the server removes A's expired lease message on its own clock, and a redelivery
	// that comes before that finds the lease held and is given back (see claim).
	assert.GreaterOrEqual(t, rec.all()[0].Attempt, 2, "runner B ran the delivery runner A left unsettled")

	all := effects.all()
	firstB := -1
	for i, ef := range all {
		if ef.by == "b" {
			firstB = i
			break
		}
	}
	require.GreaterOrEqual(t, firstB, 0)
	for _, ef := range all[firstB:] {
		assert.Equal(t, "b", ef.by, "runner A acted after runner B started")
	}
	assert.Greater(t, effects.count("a"), 1, "runner A worked until the freeze")

	// The bytes held during the freeze (runner A's last InProgress) change nothing now.
	proxy.Thaw()
	holdsFor(t, 300*time.Millisecond, func() bool { return rec.count() == 1 && e.streamMsgs(t) == 0 }, "the job ran once more only")
}

// A consumer whose NATS connection is reset in the middle of a job reconnects and renews its
// lease again: the job is neither lost nor run twice. (A renewal made while the connection is
// down fails at once, without a reconnect buffer; the next one after the reconnect counts.)
//
// Not parallel: a starved test could miss its renewals and lose the lease, which is the rule.
func TestResetConnectionKeepsTheLeaseAfterTheReconnect(t *testing.T) {
	const ackWait = 3 * time.Second
	e := newEnv(t, ackWait)
	proxy := e.srv.NewProxy(t)
	nc, err := natsjs.Connect(t.Context(), natsjs.Options{URLs: proxy.URL(), Name: "reset", NoReconnectBuffer: true}, testLogger(t))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	reconnected := make(chan struct{}, 1)
	nc.SetReconnectHandler(func(*nats.Conn) { reconnected <- struct{}{} })

	started, release := make(chan *Job, 1), make(chan struct{})
	var obs results
	cfg := testConfig()
	cfg.Observer = &obs
	start(t, e.newRunner(t, js, cfg, func(ctx context.Context, job *Job) error {
		started <- job
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}))
	e.publish(t, "reset", events.TypeUpdated)
	var job *Job
	select {
	case job = <-started:
	case <-time.After(waitFor):
		t.Fatal("the runner did not take the job")
	}
	proxy.Cut()
	select {
	case <-reconnected:
	case <-time.After(waitFor):
		t.Fatal("no reconnect")
	}
	cut := time.Now()
	require.Eventually(t, func() bool {
		from, _ := job.lease.renewedAt()
		return from.After(cut)
	}, waitFor, tick, "a renewal after the reconnect was confirmed")
	// Past the AckWait that started before the cut: the lease holds on renewals made after it.
	holdsFor(t, ackWait, job.Held, "the lease held across the reset")
	close(release)
	require.Eventually(t, func() bool { return obs.get(ResultOK) == 1 }, waitFor, tick)
	e.requireDrained(t)
	assert.Equal(t, uint64(1), e.consumerInfo(t).Delivered.Consumer, "delivered once")
}
