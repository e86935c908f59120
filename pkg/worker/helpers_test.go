package worker

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

const (
	group   = events.GroupReplicate
	waitFor = 20 * time.Second
	tick    = 10 * time.Millisecond
)

// env is an embedded NATS server with the Spiegel topology installed.
type env struct {
	srv  *natstest.Server
	js   jetstream.JetStream
	topo natsjs.Topology
	jobs *natsjs.Jobs
}

func newEnv(t testing.TB, ackWait time.Duration) *env {
	t.Helper()
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := natsjs.DefaultTopology("")
	if ackWait > 0 {
		topo.AckWait = ackWait
	}
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	return &env{srv: srv, js: js, topo: topo, jobs: natsjs.NewJobs(js, topo.Subjects)}
}

// testLogger logs to the test's output with WORKER_TEST_LOG=1, and nowhere otherwise.
func testLogger(t testing.TB) logrus.FieldLogger {
	l := logrus.New()
	l.SetOutput(io.Discard)
	if os.Getenv("WORKER_TEST_LOG") != "" {
		w := &testWriter{t: t}
		t.Cleanup(w.close) // registered first, so it runs after the runners stopped
		l.SetOutput(w)
		l.SetLevel(logrus.DebugLevel)
	}
	return l
}

// testWriter writes to t.Log until the test ends.
type testWriter struct {
	mu     sync.Mutex
	t      testing.TB
	closed bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (w *testWriter) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
}

// testConfig is a config with delays small enough for tests.
func testConfig() Config {
	return Config{
		Group:       group,
		Concurrency: 4,
		Grace:       2 * time.Second,
		Retry:       backoff.Policy{Initial: 50 * time.Millisecond, Max: 200 * time.Millisecond, Multiplier: 2},
	}
}

func (e *env) newRunner(t testing.TB, js jetstream.JetStream, cfg Config, h Handler) *Runner {
	t.Helper()
	if js == nil {
		js = e.js
	}
	r, err := New(js, e.topo.Subjects, cfg, h, testLogger(t))
	require.NoError(t, err)
	return r
}

// running is a Runner started in the background.
type running struct {
	cancel context.CancelFunc
	done   chan error
}

// start runs r until stop is called or the test ends.
func start(t testing.TB, r *Runner) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	rr := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-rr.done:
		case <-time.After(waitFor):
			t.Error("runner did not stop")
		}
	})
	return rr
}

// stop cancels the runner, requires Run to return nil and returns how long it took to return.
func (rr *running) stop(t *testing.T) time.Duration {
	t.Helper()
	began := time.Now()
	rr.cancel()
	select {
	case err := <-rr.done:
		rr.done <- err // for the cleanup
		require.NoError(t, err)
		return time.Since(began)
	case <-time.After(waitFor):
		t.Fatal("runner did not stop")
		return 0
	}
}

func (e *env) publish(t testing.TB, db, reason string) {
	t.Helper()
	dedup, err := e.jobs.Publish(t.Context(), group, events.Job{DB: db, Reason: reason})
	require.NoError(t, err)
	require.False(t, dedup, "job for %q was already pending", db)
}

func (e *env) consumerInfo(t *testing.T) *jetstream.ConsumerInfo {
	t.Helper()
	c, err := e.js.Consumer(t.Context(), e.topo.Subjects.WorkStream(), group.ConsumerName())
	require.NoError(t, err)
	info, err := c.Info(t.Context())
	require.NoError(t, err)
	return info
}

func (e *env) streamMsgs(t *testing.T) uint64 {
	t.Helper()
	s, err := e.js.Stream(t.Context(), e.topo.Subjects.WorkStream())
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	return info.State.Msgs
}

// requireDrained waits until every job is settled: no message in the stream, none pending ack.
func (e *env) requireDrained(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		return e.streamMsgs(t) == 0 && e.consumerInfo(t).NumAckPending == 0
	}, waitFor, tick, "work stream not drained")
}

func (e *env) deadLetter(t *testing.T, db string) DeadLetter {
	t.Helper()
	s, err := e.js.Stream(t.Context(), e.topo.Subjects.DeadLetterStream())
	require.NoError(t, err)
	msg, err := s.GetLastMsgForSubject(t.Context(), e.topo.Subjects.DeadLetter(group, db))
	require.NoError(t, err)
	var rec DeadLetter
	require.NoError(t, json.Unmarshal(msg.Data, &rec))
	return rec
}

func (e *env) deadLetterCount(t *testing.T) uint64 {
	t.Helper()
	s, err := e.js.Stream(t.Context(), e.topo.Subjects.DeadLetterStream())
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	return info.State.Msgs
}

// call is one handler invocation as a test saw it.
type call struct {
	DB      string
	Reason  string
	Attempt int
	At      time.Time
}

// recorder records handler calls.
type recorder struct {
	mu    sync.Mutex
	calls []call
}

func (r *recorder) add(job *Job) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, call{DB: job.DB, Reason: job.Reason, Attempt: job.Attempt, At: time.Now()})
	return len(r.calls)
}

func (r *recorder) all() []call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]call(nil), r.calls...)
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// results is an Observer that counts results.
type results struct {
	mu     sync.Mutex
	counts map[string]int
	order  []string
}

func (o *results) JobDone(g events.Group, result string, _ time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.counts == nil {
		o.counts = map[string]int{}
	}
	o.counts[string(g)+"/"+result]++
	o.order = append(o.order, result)
}

func (o *results) get(result string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.counts[string(group)+"/"+result]
}

func (o *results) sequence() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.order...)
}

// holdsFor checks cond every tick for d and fails as soon as it is false. Unlike require.Never,
// cond runs on the test's goroutine: it may use t (and t.Context()) and is never left running
// when the test ends.
func holdsFor(t *testing.T, d time.Duration, cond func() bool, what string) {
	t.Helper()
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(tick) {
		require.True(t, cond(), what)
	}
}
