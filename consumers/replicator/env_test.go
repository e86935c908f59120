package main

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// TestMain lets the test binary act as the replicator binary (SPIEGEL_TEST_AS_REPLICATOR=1), so
// the crash test can SIGKILL a real replicator process.
func TestMain(m *testing.M) {
	if os.Getenv("SPIEGEL_TEST_AS_REPLICATOR") == "1" {
		main()
		return
	}
	code := m.Run()
	cleanupBinaries()
	os.Exit(code)
}

// env is one isolated installation: its own NATS server, spiegel db and db-name prefix on the
// shared test CouchDB.
type env struct {
	couch  *couchtest.Server
	nats   *natstest.Server
	js     jetstream.JetStream
	cfg    config.Replicator
	prefix string
	logs   *syncBuffer
}

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

// newEnv installs the streams, consumers and spiegel db (what `producer install` would) with
// the given AckWait.
func newEnv(t testing.TB, ackWait time.Duration) *env {
	t.Helper()
	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	e := &env{couch: cs, nats: ns, js: js, logs: &syncBuffer{}, prefix: couchtest.UniqueName(t, "r") + "_"}
	e.cfg = config.Replicator{
		Consumer: config.Consumer{
			CouchDB:     config.CouchDB{CouchDBURL: cs.URL, DBName: e.prefix + "spiegel", CouchDBTimeout: 30 * time.Second},
			NATS:        config.NATS{NATSURL: ns.URL(), SubjectPrefix: "spiegel", StreamReplicas: 1, AckWait: ackWait},
			Log:         config.Log{LogLevel: "debug", LogFormat: "json"},
			Concurrency: 8, ShutdownGrace: 5 * time.Second, RetryInitial: time.Second, RetryMax: time.Minute,
		},
		ReplicationTimeout: time.Minute, Engine: "couchdb",
	}
	topo := natsjs.DefaultTopology("spiegel")
	topo.AckWait = ackWait
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	cs.CreateDB(t, e.cfg.DBName)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("replicator logs (tail):\n%s", tail(e.logs.String(), 40))
		}
	})
	return e
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
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

// runApp opens a replicator consumer app with cfg, logging into e.logs, and runs the handler
// built by handler with the health listener on httpAddr ("" for none) until the test ends.
func (e *env) runApp(t testing.TB, cfg *config.Replicator, httpAddr string, handler func(*consumer.App) worker.Handler) *consumer.App {
	t.Helper()
	log := logrus.New()
	log.SetOutput(e.logs)
	log.SetLevel(logrus.DebugLevel)
	log.SetFormatter(&logrus.JSONFormatter{})
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
func (e *env) publish(t testing.TB, db string) {
	t.Helper()
	_, err := natsjs.NewJobs(e.js, events.NewSubjects("spiegel")).Publish(t.Context(), events.GroupReplicate, events.Job{DB: db})
	require.NoError(t, err)
}

// workMsgs returns the messages (pending or in flight) of the work stream.
func (e *env) workMsgs(t testing.TB) uint64 {
	t.Helper()
	s, err := e.js.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	return info.State.Msgs
}

// redelivered returns how many messages of the replicate consumer were delivered more than once.
func (e *env) redelivered(t testing.TB) int {
	t.Helper()
	c, err := e.js.Consumer(t.Context(), "SPIEGEL_WORK", "replicator")
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
		if e.workMsgs(t) == 0 && !p.busy() {
			quiet++
		} else {
			quiet = 0
		}
		return quiet >= 3
	}, within, 200*time.Millisecond, "the pipeline did not go quiet")
}

// deadLetters returns the dead-letter records stored so far.
func (e *env) deadLetters(t testing.TB) []string {
	t.Helper()
	c, err := e.js.OrderedConsumer(t.Context(), "SPIEGEL_DEADLETTER", jetstream.OrderedConsumerConfig{})
	require.NoError(t, err)
	var out []string
	for {
		msgs, err := c.FetchNoWait(100)
		require.NoError(t, err)
		n := 0
		for m := range msgs.Messages() {
			out = append(out, string(m.Data()))
			n++
		}
		if n == 0 {
			return out
		}
	}
}
