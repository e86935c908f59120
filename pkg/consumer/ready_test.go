package consumer_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

// runApp opens a consumer of group g and runs it (health on addr, jobs doing nothing) until the
// test ends.
func runApp(t *testing.T, cfg *config.Consumer, g events.Group, addr string, log logrus.FieldLogger) *consumer.App {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	app, err := consumer.Open(ctx, cfg, g, log)
	require.NoError(t, err)
	runOpened(t, ctx, cancel, app, addr)
	return app
}

// runOpened runs app under ctx until the test ends, when cancel stops it; the channel gets what
// Run returned.
func runOpened(t *testing.T, ctx context.Context, cancel context.CancelFunc, app *consumer.App, addr string) <-chan error {
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, addr, func(context.Context, *worker.Job) error { return nil }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(20 * time.Second):
			t.Error("consumer did not stop within 20s")
		}
	})
	return done
}

// A consumer's /readyz turns 503 while CouchDB or NATS is down, naming the failing dependency
// (and only it), and 200 again once it is back, without a restart; /healthz stays 200 all along,
// so an orchestrator stops routing to the process but does not kill it.
func TestReadyzFollowsDependencies(t *testing.T) {
	t.Parallel()
	s := newConsumerSetup(t)
	cs, ns, proxy, spiegelDB := s.cs, s.ns, s.proxy, s.cfg.DBName
	s.log.SetLevel(logrus.DebugLevel)
	addr := healthtest.FreeAddr(t)
	runApp(t, &s.cfg, events.GroupOnChange, addr, s.log)

	allOK := func(r healthtest.Ready) {
		t.Helper()
		assert.True(t, r.Ready)
		assert.Equal(t, map[string]string{"couchdb": "ok", "nats": "ok", "consumer": "ok"}, r.Checks)
	}
	live := func() {
		t.Helper()
		status, err := healthtest.GetStatus(addr, "/healthz")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "/healthz must not depend on CouchDB or NATS")
	}
	allOK(healthtest.WaitReady(t, addr, http.StatusOK, 10*time.Second))

	t.Log("CouchDB down")
	proxy.Cut()
	r := healthtest.WaitReady(t, addr, http.StatusServiceUnavailable, 10*time.Second)
	assert.False(t, r.Ready)
	assert.NotEqual(t, "ok", r.Checks["couchdb"], "the body names CouchDB as failing")
	assert.Contains(t, r.Checks["couchdb"], spiegelDB, "the error says what was asked of CouchDB")
	assert.Equal(t, "ok", r.Checks["nats"])
	assert.Equal(t, "ok", r.Checks["consumer"])
	if pw := couchPassword(cs.URL); pw != "" {
		assert.NotContains(t, r.Checks["couchdb"], pw, "no secret in the body")
	}
	t.Logf("503 body while CouchDB is down: %+v", r)
	live()
	proxy.Restore(t)
	allOK(healthtest.WaitReady(t, addr, http.StatusOK, 15*time.Second))

	t.Log("NATS down")
	ns.Stop()
	// The first 503 may come from the consumer lookup timing out before the client has noticed
	// the lost connection. Once it has, both NATS checks say so at once (no JetStream request
	// that would wait for a reconnect until the probe times out).
	r = healthtest.WaitReadyWhen(t, addr, 10*time.Second, "503 naming NATS in both NATS checks", func(status int, r healthtest.Ready) bool {
		return status == http.StatusServiceUnavailable && strings.Contains(r.Checks["nats"], "not connected") &&
			strings.Contains(r.Checks["consumer"], "NATS not connected")
	})
	assert.False(t, r.Ready)
	t.Logf("503 body while NATS is down: %+v", r)
	assert.Equal(t, "ok", r.Checks["couchdb"])
	live()
	ns.StartAgain(t)
	allOK(healthtest.WaitReady(t, addr, http.StatusOK, 15*time.Second))
}

// couchPassword returns the password of a URL with credentials ("" without one).
func couchPassword(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		return ""
	}
	pw, _ := u.User.Password()
	return pw
}

// consumerSetup is what the start-up tests share: a consumer's config over the test CouchDB
// (through a proxy the test controls) and an embedded NATS with the topology installed, and a
// logger whose output the test reads (and prints when it fails).
type consumerSetup struct {
	cfg   config.Consumer
	cs    *couchtest.Server
	ns    *natstest.Server
	proxy *couchtest.Proxy
	logs  *syncBuffer
	log   *logrus.Logger
}

func newConsumerSetup(t *testing.T) consumerSetup {
	t.Helper()
	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	require.NoError(t, natsjs.Ensure(t.Context(), js, natsjs.DefaultTopology("spiegel")))
	spiegelDB := couchtest.UniqueName(t, "c") + "_spiegel"
	cs.CreateDB(t, spiegelDB)
	proxy := cs.NewProxy(t)
	s := consumerSetup{cs: cs, ns: ns, proxy: proxy, logs: &syncBuffer{}, log: logrus.New(), cfg: config.Consumer{
		CouchDB:     config.CouchDB{CouchDBURL: proxy.URL(cs.URL), DBName: spiegelDB, CouchDBTimeout: 2 * time.Second},
		NATS:        config.NATS{NATSURL: ns.URL(), SubjectPrefix: "spiegel", StreamReplicas: 1, AckWait: 30 * time.Second},
		Concurrency: 2, ShutdownGrace: 2 * time.Second, RetryInitial: 100 * time.Millisecond, RetryMax: time.Second,
	}}
	s.log.SetOutput(s.logs)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("consumer logs:\n%s", s.logs.String())
		}
	})
	return s
}

// waitRetrying waits until the logs say line (the consumer is retrying, or running) and fails
// the test if returned yields first (the consumer gave up) or within passes.
func (s consumerSetup) waitRetrying(t *testing.T, line string, returned <-chan error, within time.Duration) {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(within)
	for !strings.Contains(s.logs.String(), line) {
		select {
		case err := <-returned:
			t.Fatalf("returned while its dependency was down: %v", err)
		case <-deadline:
			t.Fatalf("never logged %q within %s", line, within)
		case <-tick.C:
		}
	}
}

// A consumer started while CouchDB does not answer waits for it instead of exiting (SPEC §4.8:
// never exit on a transient error), and starts once it is back.
func TestOpenWaitsOutCouchDB(t *testing.T) {
	t.Parallel()
	s := newConsumerSetup(t)
	s.proxy.Cut()
	opened := make(chan error, 1)
	go func() {
		_, err := consumer.Open(t.Context(), &s.cfg, events.GroupReplicate, s.log)
		opened <- err
	}()
	s.waitRetrying(t, "while the rules were loading: retrying", opened, 20*time.Second)
	s.proxy.Restore(t)
	select {
	case err := <-opened:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Open did not return within 30s of CouchDB's return")
	}
}

// A consumer whose JetStream does not answer when it starts running (NATS restarting, a leader
// election) waits for it instead of exiting, and runs once it is back.
func TestRunWaitsOutJetStream(t *testing.T) {
	t.Parallel()
	s := newConsumerSetup(t)
	addr := healthtest.FreeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	app, err := consumer.Open(ctx, &s.cfg, events.GroupReplicate, s.log)
	require.NoError(t, err)

	s.ns.Stop()
	done := runOpened(t, ctx, cancel, app, addr)
	s.waitRetrying(t, "did not answer the installation check, retrying", done, 30*time.Second)
	s.ns.StartAgain(t)
	s.waitRetrying(t, "consumer running", done, 30*time.Second)
	r := healthtest.WaitReady(t, addr, http.StatusOK, 30*time.Second)
	assert.Equal(t, "ok", r.Checks["consumer"])
}

// Behind SPIEGEL_COUCHDB_MAX_CONNECTIONS, the readiness check has a connection of its own: with
// the process's only capped connection held by a request (a slow CouchDB, a pool full of jobs'
// requests), /readyz still answers 200 instead of timing out on the pool.
func TestReadyzOutsideTheCap(t *testing.T) {
	t.Parallel()
	s := newConsumerSetup(t)
	spiegelDB := s.cfg.DBName
	addr := healthtest.FreeAddr(t)
	cfg := s.cfg
	cfg.CouchDBURL, cfg.CouchDBTimeout, cfg.CouchDBMaxConns = s.cs.URL, 30*time.Second, 1
	ctx := t.Context()
	app := runApp(t, &cfg, events.GroupOnChange, addr, s.log)
	healthtest.WaitReady(t, addr, http.StatusOK, 10*time.Second)

	// A request whose body is not sent yet holds the one connection of the cap.
	pr, pw := io.Pipe()
	held := make(chan error, 1)
	gotConn := make(chan struct{})
	hctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{GotConn: func(httptrace.GotConnInfo) { close(gotConn) }})
	go func() {
		held <- app.Couch.Do(hctx, http.MethodPost, app.Couch.DBPath(spiegelDB)+"/_bulk_docs", nil, pr, nil)
	}()
	select {
	case <-gotConn:
	case <-time.After(10 * time.Second):
		t.Fatal("the held request got no connection")
	}
	blocked := make(chan error, 1)
	go func() { _, err := app.Couch.DBInfo(ctx, spiegelDB); blocked <- err }()
	select {
	case err := <-blocked:
		t.Fatalf("a second capped request went through while the first held the connection: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	for range 2 { // each within health's check timeout (3 s), which a wait for the pool would use up
		status, err := healthtest.GetStatus(addr, "/readyz")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "readiness waited behind the capped pool")
	}
	_, _ = pw.Write([]byte(`{"docs":[]}`))
	require.NoError(t, pw.Close())
	require.NoError(t, <-held)
	<-blocked
}
