package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
)

// TestMain lets the test binary act as the producer binary, so crash tests can SIGKILL a real
// producer process without a separate build step. Tests skipped for want of a CouchDB are
// reported in one line (couchtest.Main).
func TestMain(m *testing.M) {
	if os.Getenv("SPIEGEL_TEST_AS_PRODUCER") == "1" {
		main()
		return
	}
	os.Exit(couchtest.Main(m))
}

// env is one isolated Spiegel installation: its own NATS server, spiegel db and db-name prefix
// on the shared test CouchDB. The producer and the test's writes go through an updates proxy
// (couchtest.UpdatesProxy), so the producer follows a _db_updates feed with real, opaque
// positions on PouchDB Server as on CouchDB: a restart resumes from a saved position rather
// than re-emitting every db, which the poll source would do and so hide position bugs.
type env struct {
	*spiegeltest.Env                         // its Couch goes through the updates proxy: writes are events
	direct           *couchtest.Server       // the server itself: writes the feed never sees (a dropped event)
	updates          *couchtest.UpdatesProxy // the producer's CouchDB
	cfg              config.Producer
}

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

// newEnv installs a fresh environment with `producer install`; opts tune its updates proxy.
// The reconciliation sweep is off: no consumer records jobs done here, so its first sweep would
// enqueue every matched db and hide what a test looks at (positions, resyncs, catch-ups). The
// sweep's tests turn it on.
func newEnv(t *testing.T, opts ...couchtest.UpdatesProxyOption) *env {
	t.Helper()
	direct := couchtest.Get(t)
	updates := direct.NewUpdatesProxy(t, opts...)
	e := &env{Env: spiegeltest.New(t, spiegeltest.Options{Name: "p", Couch: updates.Server()}), direct: direct, updates: updates}
	e.cfg = config.Producer{
		CouchDB: e.CouchDBConfig(), NATS: e.NATSConfig(60 * time.Second), Log: e.LogConfig(),
		Source: "auto", Start: "beginning", FeedHeartbeat: 2 * time.Second, PollInterval: 200 * time.Millisecond,
		SweepInterval: 0, PositionSaveInterval: 200 * time.Millisecond, MaxInflight: 256,
		ShutdownGrace: 5 * time.Second,
	}
	out := e.run(t, "install")
	require.Contains(t, out, "install complete")
	return e
}

// run runs an admin command in-process and returns its stdout; it fails the test on error.
func (e *env) run(t *testing.T, cmd string, args ...string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	fn := commands[cmd]
	require.NotNil(t, fn, cmd)
	cfg := e.cfg
	err := fn(t.Context(), &cfg, e.Logger(), cmdIO{args: args, stdin: strings.NewReader(""), stdout: &out, stderr: &errOut})
	require.NoError(t, err, "producer %s: %s", cmd, errOut.String())
	return out.String() + errOut.String()
}

// startProducer runs a producer in-process until the returned stop function is called.
func (e *env) startProducer(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	cfg := e.cfg
	log := e.Logger()
	go func() { done <- producer.Run(ctx, &cfg, log) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Error("producer did not stop within 30s")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// putRule writes a rule doc into the spiegel db.
func (e *env) putRule(t *testing.T, id string, doc map[string]any) string {
	t.Helper()
	return e.Couch.Put(t, e.cfg.DBName, id, doc)
}

// deleteDoc deletes a doc with a plain DELETE (a tombstone without a body).
func (e *env) deleteDoc(t *testing.T, db, id, rev string) {
	t.Helper()
	require.NoError(t, e.Couch.Do(t, "DELETE", "/"+couchtest.PathDB(db)+"/"+id+"?rev="+rev, nil, nil))
}

func work(g events.Group, db string) string { return events.NewSubjects("").Work(g, db) }

// waitJob waits until a job for (g, db) is pending.
func (e *env) waitJob(t *testing.T, g events.Group, db string, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool { return e.Pending(t)[work(g, db)] == 1 }, within, 50*time.Millisecond,
		"no %s job for %s within %s", g, db, within)
}

// jobReason returns the reason in the payload of the pending job of (g, db).
func (e *env) jobReason(t *testing.T, g events.Group, db string) string {
	t.Helper()
	s, err := e.JS.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err)
	m, err := s.GetLastMsgForSubject(t.Context(), work(g, db))
	require.NoError(t, err)
	job, err := events.UnmarshalJob(m.Data)
	require.NoError(t, err)
	return job.Reason
}

// writeDocs writes n docs to db with `workers` parallel writers.
func (e *env) writeDocs(t *testing.T, db string, n, workers int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	ch := make(chan int)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range ch {
				_, err := e.Couch.Client.DB(db).Put(context.Background(), fmt.Sprintf("doc%05d", i), map[string]any{"n": i})
				if err != nil {
					errs <- err
				}
			}
		}()
	}
	for i := range n {
		ch <- i
	}
	close(ch)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}
