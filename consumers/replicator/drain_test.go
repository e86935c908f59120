package main

import (
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
)

// SIGTERM to a replicator process whose replication outlives the grace period: the process
// cancels it at the end of the grace period, hands the job back (nak) and exits 0 soon after; the
// job is not lost: a second instance gets it at once (well before AckWait) and the target
// converges.
func TestSIGTERMDrainHandsBackSlowReplication(t *testing.T) {
	t.Parallel()
	const (
		grace   = 2 * time.Second
		ackWait = 60 * time.Second // a job left to AckWait would not come back within this test
	)
	e := newEnv(t, ackWait)
	src, tgt := e.Prefix+"slow", e.Prefix+"slow_copy"
	e.Couch.CreateDB(t, src)
	e.Couch.CreateDB(t, tgt)
	bulkDocs(t, e.Couch, src, 0, 50)
	e.Couch.Put(t, e.cfg.DBName, "slow", map[string]any{"type": "replicator", "source": src, "target": tgt})

	started, proxyURL := e.stallingProxy(t)
	logs := &syncBuffer{}
	cmd := exec.Command(os.Args[0])
	cmd.Env = e.processEnv(proxyURL, "SPIEGEL_TEST_AS_REPLICATOR=1", "SPIEGEL_SHUTDOWN_GRACE="+grace.String())
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		if t.Failed() {
			t.Logf("replicator process logs (tail):\n%s", spiegeltest.Tail(logs.String(), 30))
		}
	})
	e.publish(t, src)
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the process never started the replication")
	}

	sent := time.Now()
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	var err error
	select {
	case err = <-exited:
	case <-time.After(grace + 15*time.Second):
		t.Fatalf("the process did not exit within %s of SIGTERM", grace+15*time.Second)
	}
	took := time.Since(sent)
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		t.Fatalf("exit code %d", exit.ExitCode())
	}
	require.NoError(t, err)
	assert.GreaterOrEqual(t, took, grace, "the running job had its grace period")
	assert.Less(t, took, grace+5*time.Second, "the process exits soon after the grace period")
	assert.Contains(t, logs.String(), "job interrupted by shutdown: nak'ed for a redelivery")
	assert.NotContains(t, logs.String(), "abandoned")
	assert.Empty(t, revs(t, e.Couch, tgt), "the replication never ran")
	assert.EqualValues(t, 1, e.WorkMsgs(t), "the job is still in the work queue")

	handedBack := time.Now()
	p := e.startReplicator(t, nil)
	waitConverged(t, e.Couch, src, tgt, 15*time.Second)
	assert.Less(t, time.Since(handedBack), ackWait, "the job came back by its nak, not by AckWait")
	attempts := p.attemptsOf(src)
	require.NotEmpty(t, attempts)
	assert.Equal(t, 2, attempts[0], "the second instance ran the handed-back delivery")
}
