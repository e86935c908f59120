package publisher

import (
	"context"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// The publish pipeline's one promise: Safe never passes a position whose jobs, and all jobs
// before them, are not acknowledged by JetStream — whatever order the answers come in, whether
// they fail, never come, or say "duplicate". These tests drive it with a fake publisher whose
// answers the test gives.

var (
	errDuplicate = &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages per subject exceeded"}
	errFull      = &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum bytes exceeded"}
)

// fakeJobs is a Jobs. Each async publish gets a future the test answers with answer();
// sync publishes (the pipeline's retries, Offer) take their results from syncResults, in order,
// then succeed; MarkAndRetry records a wakeup marker.
type fakeJobs struct {
	mu          sync.Mutex
	futures     map[string]*fakeFuture // by db
	published   map[string]int         // async publishes by db
	syncCalls   []string
	syncResults []error
	marks       []string
}

func newFakeJobs() *fakeJobs {
	return &fakeJobs{futures: map[string]*fakeFuture{}, published: map[string]int{}}
}

// publishes returns the number of async publishes of db's job so far.
func (f *fakeJobs) publishes(db string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.published[db]
}

func (f *fakeJobs) PublishAsync(_ events.Group, job events.Job) (jetstream.PubAckFuture, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fut := &fakeFuture{ok: make(chan *jetstream.PubAck, 1), err: make(chan error, 1)}
	f.futures[job.DB] = fut
	f.published[job.DB]++
	return fut, nil
}

// Offer is the synchronous republish after a failure; its results come from syncResults.
func (f *fakeJobs) Offer(_ context.Context, _ events.Group, job events.Job) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.syncCalls = append(f.syncCalls, job.DB)
	if len(f.syncResults) == 0 {
		return false, nil
	}
	err := f.syncResults[0]
	f.syncResults = f.syncResults[1:]
	if err == errDuplicate { // not errors.Is: an APIError matches any other of the same code
		return true, nil
	}
	return false, err
}

// MarkAndRetry records the wakeup marker of a refused job; the job stays pending (deduplicated).
// Publish is Offer without the marker: the answers come from the same list.
func (f *fakeJobs) Publish(ctx context.Context, g events.Group, job events.Job) (bool, error) {
	return f.Offer(ctx, g, job)
}

func (f *fakeJobs) MarkAndRetry(_ context.Context, _ events.Group, job events.Job) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.marks = append(f.marks, job.DB)
	return true, nil
}

// answer resolves the future of db's job: nil is a stored job.
func (f *fakeJobs) answer(db string, err error) {
	f.mu.Lock()
	fut := f.futures[db]
	f.mu.Unlock()
	if err != nil {
		fut.err <- err
		return
	}
	fut.ok <- &jetstream.PubAck{Stream: "SPIEGEL_WORK"}
}

func (f *fakeJobs) syncs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.syncCalls...)
}

type fakeFuture struct {
	ok  chan *jetstream.PubAck
	err chan error
}

func (f *fakeFuture) Ok() <-chan *jetstream.PubAck { return f.ok }
func (f *fakeFuture) Err() <-chan error            { return f.err }
func (f *fakeFuture) Msg() *nats.Msg               { return &nats.Msg{} }

// runPublisher starts a publisher over jobs and returns it with its metrics.
func runPublisher(t *testing.T, jobs Jobs, ackTimeout time.Duration) (*Pipeline, *metrics.Producer) {
	t.Helper()
	m := metrics.NewProducer(prometheus.NewRegistry())
	log := logrus.New()
	log.SetOutput(io.Discard)
	p := New(jobs, 64, m, log)
	p.ackTimeout = ackTimeout
	p.SetSafe("start")
	ctx, cancel := context.WithCancel(context.Background())
	go p.Run(ctx, time.Second)
	t.Cleanup(func() { cancel(); p.Wait() })
	return p, m
}

// enqueue hands in position seq with one replicate job for db seq.
func enqueue(t *testing.T, p *Pipeline, seqs ...string) {
	t.Helper()
	for _, s := range seqs {
		require.NoError(t, p.Enqueue(t.Context(), s, true, s, events.TypeUpdated, []events.Group{events.GroupReplicate}))
	}
}

// requireSafe waits until Safe is want; stays reports whether it should not move from it.
func requireSafe(t *testing.T, p *Pipeline, want string) {
	t.Helper()
	require.Eventually(t, func() bool { return p.Safe() == want }, 5*time.Second, time.Millisecond, "safe %q, want %q", p.Safe(), want)
}

func counter(c *prometheus.CounterVec) float64 {
	return testutil.ToFloat64(c.WithLabelValues(string(events.GroupReplicate)))
}

func TestPublisherAnswersOutOfOrder(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	p, m := runPublisher(t, jobs, time.Minute)
	enqueue(t, p, "1", "2", "3", "4", "5")
	for _, db := range []string{"5", "4", "3"} {
		jobs.answer(db, nil)
	}
	require.Never(t, func() bool { return p.Safe() != "start" }, 50*time.Millisecond, time.Millisecond, "safe moved past the unanswered 1")
	jobs.answer("1", nil)
	requireSafe(t, p, "1")
	require.Never(t, func() bool { return p.Safe() != "1" }, 50*time.Millisecond, time.Millisecond, "safe moved past the unanswered 2")
	jobs.answer("2", nil)
	requireSafe(t, p, "5")
	assert.Equal(t, 5.0, counter(m.JobsPublished))
	assert.True(t, p.Idle())
}

func TestPublisherRetriesFailures(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	jobs.syncResults = []error{errFull, fmt.Errorf("nats: connection closed")} // then success
	p, m := runPublisher(t, jobs, time.Minute)
	enqueue(t, p, "1", "2")
	jobs.answer("2", nil)
	jobs.answer("1", errFull) // a full stream: not a duplicate
	requireSafe(t, p, "2")
	assert.Equal(t, []string{"1", "1", "1"}, jobs.syncs(), "republished until stored")
	assert.Equal(t, 3.0, counter(m.PublishErrors))
	assert.Equal(t, 2.0, counter(m.JobsPublished))
	assert.Zero(t, counter(m.JobsDeduped))
}

func TestPublisherDuplicateIsSettled(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	p, m := runPublisher(t, jobs, time.Minute)
	enqueue(t, p, "1")
	jobs.answer("1", errDuplicate)
	requireSafe(t, p, "1")
	assert.Empty(t, jobs.syncs())
	jobs.mu.Lock()
	assert.Equal(t, []string{"1"}, jobs.marks, "a refused job leaves its wakeup marker")
	jobs.mu.Unlock()
	assert.Equal(t, 1.0, counter(m.JobsDeduped))
	assert.Zero(t, counter(m.PublishErrors))
}

func TestPublisherAnswerThatNeverComes(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	p, m := runPublisher(t, jobs, 20*time.Millisecond)
	enqueue(t, p, "1", "2")
	jobs.answer("2", nil) // 1 never gets an answer
	requireSafe(t, p, "2")
	assert.Equal(t, []string{"1"}, jobs.syncs(), "published again after the ack timeout")
	assert.Equal(t, 1.0, counter(m.PublishErrors))
}

func TestPublisherAnswersLostTogetherTimeOutTogether(t *testing.T) {
	t.Parallel()
	const timeout = 2 * time.Second
	jobs := newFakeJobs()
	p, m := runPublisher(t, jobs, timeout)
	enqueue(t, p, "1", "2", "3", "4") // none ever gets an answer
	require.Eventually(t, func() bool { return len(jobs.syncs()) > 0 }, 10*timeout, time.Millisecond)
	// Each publish's answer was due timeout after it was sent: the other three are overdue too
	// and are published again at once, not timeout after one another.
	require.Eventually(t, func() bool { return len(jobs.syncs()) == 4 }, timeout/2, time.Millisecond,
		"republished so far: %v", jobs.syncs())
	requireSafe(t, p, "4")
	assert.Equal(t, 4.0, counter(m.PublishErrors))
}

func TestPublisherSaveDueAndFlush(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	p, _ := runPublisher(t, jobs, time.Minute)
	require.NoError(t, p.Enqueue(t.Context(), "1", false, "spiegel", "", nil)) // the spiegel db's own event
	requireSafe(t, p, "1")
	_, due := p.SafeDue()
	assert.Zero(t, due, "an event of the spiegel db makes no save due")
	require.NoError(t, p.EnqueueNoSeq(t.Context(), "x", events.ReasonRule, []events.Group{events.GroupReplicate}))
	enqueue(t, p, "2")
	flushed := make(chan error, 1)
	go func() { flushed <- p.Flush(t.Context()) }()
	select {
	case <-flushed:
		t.Fatal("Flush returned before the jobs enqueued ahead of it were answered")
	case <-time.After(50 * time.Millisecond):
	}
	jobs.answer("x", nil)
	jobs.answer("2", nil)
	require.NoError(t, <-flushed)
	safe, due := p.SafeDue()
	assert.Equal(t, "2", safe, "a job without a position does not move Safe")
	assert.Equal(t, uint64(1), due)
}

// Covered events move Safe but hold the position a save may write before them until their holds
// are released — by the acknowledgement of a job published after them, never by time: a hot
// feed stalled, then stuck behind NATS, must not let the saved position pass an event nobody
// published (before, a hold ended after 30 s whatever had happened). Jobs published with
// EnqueueThen call back once settled, in order.
func TestPublisherCoveredHoldsSaveCandidate(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	p, _ := runPublisher(t, jobs, time.Minute)
	enqueue(t, p, "1")
	jobs.answer("1", nil)
	requireSafe(t, p, "1")
	h2, h3 := &Hold{}, &Hold{}
	require.NoError(t, p.Covered(t.Context(), "2", h2))
	requireSafe(t, p, "2")
	seq, due, held := p.SaveCandidate()
	assert.Equal(t, "1", seq, "the candidate stays before the covered event")
	assert.True(t, held)
	assert.Equal(t, uint64(2), due, "a covered event makes a save due")

	require.NoError(t, p.Covered(t.Context(), "3", h3))
	enqueue(t, p, "4")
	jobs.answer("4", nil)
	requireSafe(t, p, "4")
	seq, _, held = p.SaveCandidate()
	assert.Equal(t, "1", seq, "the oldest unreleased covered event decides")
	assert.True(t, held)

	// The job standing for the events is published but JetStream does not answer: still held.
	released := make(chan struct{})
	require.NoError(t, p.EnqueueThen(t.Context(), "hot", events.TypeUpdated, []events.Group{events.GroupReplicate},
		func() { p.Release([]*Hold{h2}); close(released) }))
	seq, _, held = p.SaveCandidate()
	assert.Equal(t, "1", seq, "a hold stays until the job standing for its event is acknowledged")
	assert.True(t, held)
	jobs.answer("hot", nil)
	<-released
	seq, _, held = p.SaveCandidate()
	assert.Equal(t, "2", seq, "the next unreleased hold decides")
	assert.True(t, held)
	p.Release([]*Hold{h3})
	seq, _, held = p.SaveCandidate()
	assert.Equal(t, "4", seq, "every hold released: the candidate is Safe")
	assert.False(t, held)
	assert.Zero(t, p.Holds())

	// A hold released before its covered event settles places nothing.
	h5 := &Hold{}
	p.Release([]*Hold{h5})
	require.NoError(t, p.Covered(t.Context(), "5", h5))
	requireSafe(t, p, "5")
	seq, _, held = p.SaveCandidate()
	assert.Equal(t, "5", seq)
	assert.False(t, held)

	var calls []string
	var mu sync.Mutex
	done := func(name string) func() {
		return func() { mu.Lock(); calls = append(calls, name); mu.Unlock() }
	}
	require.NoError(t, p.EnqueueThen(t.Context(), "a", events.TypeUpdated, []events.Group{events.GroupReplicate}, done("a")))
	require.NoError(t, p.EnqueueThen(t.Context(), "b", events.TypeUpdated, []events.Group{events.GroupReplicate}, done("b")))
	jobs.answer("b", nil)
	require.Never(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(calls) > 0 }, 50*time.Millisecond, time.Millisecond,
		"b's callback ran before a was settled")
	jobs.answer("a", nil)
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(calls) == 2 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"a", "b"}, calls)
	assert.Equal(t, "5", p.Safe(), "jobs without a position do not move Safe")
}
