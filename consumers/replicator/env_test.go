package main

import (
	"context"
	"encoding/json"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// TestMain lets the test binary act as the replicator binary (SPIEGEL_TEST_AS_REPLICATOR=1), so
// the crash test can SIGKILL a real replicator process. Tests skipped for want of a CouchDB are
// reported in one line (couchtest.Main).
func TestMain(m *testing.M) {
	if os.Getenv("SPIEGEL_TEST_AS_REPLICATOR") == "1" {
		main()
		return
	}
	code := couchtest.Main(m)
	cleanupBinaries()
	os.Exit(code)
}

// env is one isolated installation (spiegeltest) with a replicator configuration.
type env struct {
	*spiegeltest.Env
	cfg config.Replicator
}

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

// newEnv installs the streams, consumers and spiegel db (what `producer install` would) with
// the given AckWait.
func newEnv(t testing.TB, ackWait time.Duration) *env {
	t.Helper()
	e := &env{Env: spiegeltest.New(t, spiegeltest.Options{Name: "r", AckWait: ackWait, Install: true})}
	e.cfg = config.Replicator{
		Consumer: config.Consumer{
			CouchDB: e.CouchDBConfig(), NATS: e.NATSConfig(ackWait), Log: e.LogConfig(),
			Concurrency: 8, ShutdownGrace: 5 * time.Second, RetryInitial: time.Second, RetryMax: time.Minute,
		},
		ReplicationTimeout: time.Minute, Engine: "couchdb",
	}
	return e
}

// probe observes a replicator run in-process: handler invocations and _replicate calls per db.
type probe struct {
	app *consumer.App

	mu       sync.Mutex
	jobs     map[string]int          // handler invocations by db
	attempts map[string][]int        // delivery counts of the invocations, by db
	runs     map[string][]handlerRun // start and end of each handler invocation, by db
	reps     map[string][]time.Time  // start of each _replicate call, by db
	inFlight int
}

func (p *probe) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.jobs, p.attempts, p.reps, p.runs = map[string]int{}, map[string][]int{}, map[string][]time.Time{}, map[string][]handlerRun{}
}

// handlerRun is one handler invocation.
type handlerRun struct {
	attempt    int
	start, end time.Time
}

func (p *probe) runsOf(db string) []handlerRun {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]handlerRun(nil), p.runs[db]...)
}

func (p *probe) jobCount(db string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.jobs[db]
}

func (p *probe) jobDBs() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for k, v := range p.jobs {
		out[k] = v
	}
	return out
}

func (p *probe) replications(db string) []time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]time.Time(nil), p.reps[db]...)
}

func (p *probe) attemptsOf(db string) []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int(nil), p.attempts[db]...)
}

func (p *probe) busy() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.inFlight > 0
}

// countingEngine counts the _replicate calls of each db (the job's, from ctx).
type countingEngine struct {
	next engine
	p    *probe
}

func (c countingEngine) Replicate(ctx context.Context, body map[string]any, secrets []string) (result, error) {
	if job, ok := worker.FromContext(ctx); ok {
		c.p.mu.Lock()
		c.p.reps[job.DB] = append(c.p.reps[job.DB], time.Now())
		c.p.mu.Unlock()
	}
	return c.next.Replicate(ctx, body, secrets)
}

// startReplicator runs the replicator in-process with cfg (e.cfg when nil) until the test ends.
func (e *env) startReplicator(t testing.TB, cfg *config.Replicator) *probe {
	t.Helper()
	if cfg == nil {
		c := e.cfg
		cfg = &c
	}
	var p *probe
	e.runApp(t, cfg, "", func(app *consumer.App) worker.Handler {
		p = &probe{app: app}
		p.reset()
		h := newHandler(app.Deps, cfg)
		for name, eng := range h.engines {
			h.engines[name] = countingEngine{next: eng, p: p}
		}
		return func(ctx context.Context, job *worker.Job) error {
			p.mu.Lock()
			p.jobs[job.DB]++
			p.attempts[job.DB] = append(p.attempts[job.DB], job.Attempt)
			p.inFlight++
			p.mu.Unlock()
			start := time.Now()
			defer func() {
				p.mu.Lock()
				p.inFlight--
				p.runs[job.DB] = append(p.runs[job.DB], handlerRun{attempt: job.Attempt, start: start, end: time.Now()})
				p.mu.Unlock()
			}()
			return h.handle(ctx, job)
		}
	})
	return p
}

// runApp opens a replicator consumer app with cfg, logging into e.Logs, and runs the handler
// built by handler with the health listener on httpAddr ("" for none) until the test ends.
func (e *env) runApp(t testing.TB, cfg *config.Replicator, httpAddr string, handler func(*consumer.App) worker.Handler) *consumer.App {
	t.Helper()
	log := e.Logger()
	ctx, cancel := context.WithCancel(context.Background())
	app, err := consumer.Open(ctx, &cfg.Consumer, events.GroupReplicate, log.WithField("component", "replicator"))
	require.NoError(t, err)
	h := handler(app)
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, httpAddr, h) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("replicator did not stop within 30s")
		}
	})
	return app
}

// waitRule waits until the running replicator knows a rule matching db.
func (p *probe) waitRule(t testing.TB, db string) {
	t.Helper()
	require.Eventually(t, func() bool { return len(p.app.Rules.Replicators(db)) > 0 }, 15*time.Second, 20*time.Millisecond)
}

// publish enqueues a replicate job for db, as the producer would.
func (e *env) publish(t testing.TB, db string) { e.Enqueue(t, events.GroupReplicate, db) }

// redelivered returns how many messages of the replicate consumer were delivered more than once.
func (e *env) redelivered(t testing.TB) int {
	t.Helper()
	c, err := e.JS.Consumer(t.Context(), "SPIEGEL_WORK", "replicator")
	require.NoError(t, err)
	info, err := c.Info(t.Context())
	require.NoError(t, err)
	return info.NumRedelivered
}

// waitQuiet waits until the work stream is empty and no handler runs, three checks in a row.
func (e *env) waitQuiet(t testing.TB, p *probe, within time.Duration) {
	t.Helper()
	quiet := 0
	require.Eventually(t, func() bool {
		if e.WorkMsgs(t) == 0 && !p.busy() {
			quiet++
		} else {
			quiet = 0
		}
		return quiet >= 3
	}, within, 200*time.Millisecond, "the pipeline did not go quiet")
}

// deadLetters returns the dead-letter records stored so far, as JSON text.
func (e *env) deadLetters(t testing.TB) []string {
	t.Helper()
	var out []string
	for _, m := range spiegeltest.ReadStream[json.RawMessage](t, e.JS, "SPIEGEL_DEADLETTER") {
		out = append(out, string(m))
	}
	return out
}
