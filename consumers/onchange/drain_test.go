package main

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
)

// gate is a webhook whose first request is held until the test releases it (then it answers
// 200) or its client goes away (then it answers nothing). Later requests answer 200 at once.
type gate struct {
	*httptest.Server
	held     chan struct{} // closed when the first request arrives
	release  chan struct{} // closed by open
	opened   sync.Once
	arrivals atomic.Int64

	mu       sync.Mutex
	answered []string // doc ids answered 200, in order
}

func newGate(t *testing.T) *gate {
	g := &gate{held: make(chan struct{}), release: make(chan struct{})}
	g.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // then the server notices a client that hangs up
		if g.arrivals.Add(1) == 1 {
			close(g.held)
			select {
			case <-g.release:
			case <-r.Context().Done():
				return
			}
		}
		g.mu.Lock()
		g.answered = append(g.answered, r.URL.Query().Get("id"))
		g.mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(func() { g.open(); g.CloseClientConnections(); g.Close() })
	return g
}

// open lets the held request answer 200.
func (g *gate) open() { g.opened.Do(func() { close(g.release) }) }

func (g *gate) ids() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.answered...)
}

// child is a real onchange process: the test binary run as the onchange binary.
type child struct {
	cmd    *exec.Cmd
	logs   *syncBuffer
	exited chan struct{}
	err    error // cmd.Wait's result, once exited is closed
}

// startChild runs an onchange process of e's installation with grace as SPIEGEL_SHUTDOWN_GRACE.
func (e *env) startChild(t *testing.T, grace time.Duration) *child {
	t.Helper()
	c := &child{logs: &syncBuffer{}, exited: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0])
	c.cmd.Env = append(os.Environ(), "SPIEGEL_TEST_AS_ONCHANGE=1", "SPIEGEL_WEBHOOK_ALLOWED_HOSTS=127.0.0.1",
		"SPIEGEL_COUCHDB_URL="+e.cfg.CouchDBURL, "SPIEGEL_DB_NAME="+e.cfg.DBName, "SPIEGEL_NATS_URL="+e.NATS.URL(),
		"SPIEGEL_ACK_WAIT="+e.cfg.AckWait.String(), "SPIEGEL_SHUTDOWN_GRACE="+grace.String(),
		"SPIEGEL_HTTP_ADDR=127.0.0.1:0", "SPIEGEL_LOG_LEVEL=debug")
	c.cmd.Stdout, c.cmd.Stderr = c.logs, c.logs
	require.NoError(t, c.cmd.Start())
	go func() { c.err = c.cmd.Wait(); close(c.exited) }()
	t.Cleanup(func() {
		_ = c.cmd.Process.Kill()
		<-c.exited
		if t.Failed() {
			t.Logf("child logs:\n%s", spiegeltest.Tail(c.logs.String(), 40))
		}
	})
	return c
}

// terminate sends SIGTERM and waits up to within for the process to exit; it returns how long
// that took and the exit code.
func (c *child) terminate(t *testing.T, within time.Duration) (took time.Duration, code int) {
	t.Helper()
	sent := c.sigterm(t)
	return c.waitExit(t, sent, within)
}

// sigterm sends SIGTERM and returns when.
func (c *child) sigterm(t *testing.T) time.Time {
	t.Helper()
	sent := time.Now()
	require.NoError(t, c.cmd.Process.Signal(syscall.SIGTERM))
	return sent
}

// waitExit waits up to within after sent for the process to exit; it returns how long after
// sent it exited and the exit code.
func (c *child) waitExit(t *testing.T, sent time.Time, within time.Duration) (took time.Duration, code int) {
	t.Helper()
	select {
	case <-c.exited:
	case <-time.After(time.Until(sent.Add(within))):
		t.Fatalf("the process did not exit within %s of SIGTERM", within)
	}
	took = time.Since(sent)
	var exit *exec.ExitError
	if errors.As(c.err, &exit) {
		return took, exit.ExitCode()
	}
	require.NoError(t, c.err)
	return took, 0
}

// waitLog waits until the process has logged msg.
func (c *child) waitLog(t *testing.T, msg string, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool { return strings.Contains(c.logs.String(), msg) }, within, 10*time.Millisecond,
		"the process never logged %q", msg)
}

// drainSetup writes a rule calling g for one doc's change and a job for its db, and waits until
// a real onchange process holds the job (its request is at the gate).
func drainSetup(t *testing.T, e *env, g *gate, grace time.Duration) (c *child, db string) {
	t.Helper()
	db = e.Couch.NewDB(t, e.Prefix)
	e.putRule(t, "hook", map[string]any{"db_name": only(db), "url": g.URL + "/hook", "block": true,
		"params": map[string]any{"id": "$change.id"}})
	e.Couch.Put(t, db, "doc", map[string]any{"x": 1})
	c = e.startChild(t, grace)
	e.enqueue(t, db)
	select {
	case <-g.held:
	case <-c.exited:
		t.Fatal("the process exited before running the job")
	case <-time.After(20 * time.Second):
		t.Fatal("the process never called the webhook")
	}
	return c, db
}

// SIGTERM with a job in flight that finishes within the grace period: the process waits for it,
// the job completes and is acked (not redelivered), and the process exits 0.
func TestSIGTERMDrainFinishesRunningJob(t *testing.T) {
	t.Parallel()
	const grace = 15 * time.Second
	e := newEnv(t, 60*time.Second)
	g := newGate(t)
	c, db := drainSetup(t, e, g, grace)

	sent := c.sigterm(t)
	c.waitLog(t, "worker stopping: waiting for running jobs", 10*time.Second)
	select {
	case <-c.exited:
		t.Fatal("the process exited while its job was still running")
	default:
	}
	g.open()
	took, code := c.waitExit(t, sent, grace+10*time.Second)

	assert.Equal(t, 0, code, "exit code")
	assert.Less(t, took, grace, "the process exits once its job is done, not at the end of the grace period")
	assert.Equal(t, []string{"doc"}, g.ids(), "the change was delivered once")
	assert.EqualValues(t, 1, g.arrivals.Load(), "no second request")
	seq, ok := e.checkpoint(t, "hook", db)
	assert.True(t, ok, "the checkpoint was saved before exit")
	assert.NotEmpty(t, seq)
	assert.Zero(t, e.WorkMsgs(t), "the job was acked")
	assert.NotContains(t, c.logs.String(), "interrupted by shutdown")
	assert.Contains(t, c.logs.String(), "worker stopped")
}

// SIGTERM with a job in flight that outlives the grace period: the process cancels it at the end
// of the grace period, hands it back (nak) and exits 0 soon after; the job is not lost: a second
// instance gets it at once (well before AckWait) and delivers the change.
func TestSIGTERMDrainHandsBackSlowJob(t *testing.T) {
	t.Parallel()
	const (
		grace   = 2 * time.Second
		ackWait = 60 * time.Second // a job left to AckWait would not come back within this test
	)
	e := newEnv(t, ackWait)
	g := newGate(t)
	c, db := drainSetup(t, e, g, grace)

	took, code := c.terminate(t, grace+15*time.Second)
	assert.Equal(t, 0, code, "exit code")
	assert.GreaterOrEqual(t, took, grace, "the running job had its grace period")
	assert.Less(t, took, grace+5*time.Second, "the process exits soon after the grace period")
	assert.Contains(t, c.logs.String(), "grace period over: cancelling running jobs")
	assert.Contains(t, c.logs.String(), "job interrupted by shutdown: nak'ed for a redelivery")
	assert.NotContains(t, c.logs.String(), "abandoned")
	assert.Empty(t, g.ids(), "the held request was never answered")
	seq, _ := e.checkpoint(t, "hook", db)
	assert.Empty(t, seq, "no checkpoint past an undelivered change")
	assert.EqualValues(t, 1, e.WorkMsgs(t), "the job is still in the work queue")

	handedBack := time.Now()
	e.start(t)
	require.Eventually(t, func() bool { return len(g.ids()) == 1 }, 15*time.Second, 20*time.Millisecond,
		"the second instance did not deliver the change")
	assert.Less(t, time.Since(handedBack), ackWait, "the job came back by its nak, not by AckWait")
	assert.Equal(t, []string{"doc"}, g.ids())
	require.Eventually(t, func() bool { _, ok := e.checkpoint(t, "hook", db); return ok && e.WorkMsgs(t) == 0 },
		10*time.Second, 20*time.Millisecond, "the second instance did not finish the job")
}
