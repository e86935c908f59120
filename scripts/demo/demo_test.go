package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// The run command's demo, headless for a bounded time: the pipeline must replicate, call the
// webhook and publish to NATS, and everything it started must stop.
func TestRunCommandDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole pipeline")
	}
	srv := couchtest.Get(t)
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	for _, b := range []string{"producer", "replicator", "onchange", "nats-server"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Skipf("bin/%s is missing: the test command builds it (make build)", b)
		}
	}
	// What the demo makes: its spiegel db, and the dbs it writes under fixed names (the run
	// command's output names them), deleted when the test ends, also when it fails.
	spiegelDB := couchtest.UniqueName(t, "demo_spiegel_")
	for _, db := range []string{spiegelDB, "demo_user_alice", "demo_user_bob", "demo_user_carol", "demo_all_posts"} {
		srv.Cleanup(t, db)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "scripts/run.sh")
	cmd.Dir = root
	cmd.Env = append(os.Environ(),
		"COUCHDB_URL="+srv.URL,
		"SPIEGEL_NATS_URL=",
		"SPIEGEL_DB_NAME="+spiegelDB,
		"SPIEGEL_DEMO_DURATION=20s",
		"SPIEGEL_DEMO_INTERVAL=1s",
		"SPIEGEL_RUN_PRODUCER_ADDR=127.0.0.1:0",
		"SPIEGEL_RUN_REPLICATOR_ADDR=127.0.0.1:0",
		"SPIEGEL_RUN_ONCHANGE_ADDR=127.0.0.1:0",
	)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	t.Logf("run command output:\n%s", tail(out.String(), 80))
	require.NoError(t, err)
	s := out.String()
	assert.Contains(t, s, "replicated ")
	assert.Contains(t, s, "webhook POST /hook/demo_user_")
	assert.Contains(t, s, "nats     spiegel.changes.demo_user_")
	assert.Contains(t, s, "stopping everything this command started")
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
