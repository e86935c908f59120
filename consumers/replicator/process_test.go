package main

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
)

var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

// producerBinary builds the real producer binary once per test run.
func producerBinary(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		if binDir, binErr = os.MkdirTemp("", "spiegel-replicator-test-bin"); binErr != nil {
			return
		}
		out, err := exec.Command("go", "build", "-o", filepath.Join(binDir, "producer"), "github.com/spiegel-nats/spiegel/producer").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("build producer: %v: %s", err, out)
		}
	})
	require.NoError(t, binErr)
	return filepath.Join(binDir, "producer")
}

func cleanupBinaries() {
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
}

// processEnv is the environment of a producer or replicator process of this installation.
func (e *env) processEnv(couchURL string, extra ...string) []string {
	env := append(os.Environ(),
		"SPIEGEL_COUCHDB_URL="+couchURL,
		"SPIEGEL_DB_NAME="+e.cfg.DBName,
		"SPIEGEL_NATS_URL="+e.NATS.URL(),
		"SPIEGEL_ACK_WAIT="+e.cfg.AckWait.String(),
		"SPIEGEL_HTTP_ADDR=127.0.0.1:0",
		"SPIEGEL_LOG_LEVEL=debug",
		"SPIEGEL_REPLICATION_ENGINE="+e.cfg.Engine,
	)
	return append(env, extra...)
}

// startProducer runs `producer install`, then the real producer binary polling every 200ms,
// until the test ends.
func (e *env) startProducer(t testing.TB) *exec.Cmd {
	t.Helper()
	bin := producerBinary(t)
	env := e.processEnv(e.Couch.URL, "SPIEGEL_POLL_INTERVAL=200ms", "SPIEGEL_POSITION_SAVE_INTERVAL=500ms")
	install := exec.Command(bin, "install")
	install.Env = env
	out, err := install.CombinedOutput()
	require.NoError(t, err, "producer install: %s", out)
	logs := &syncBuffer{}
	cmd := exec.Command(bin)
	cmd.Env, cmd.Stdout, cmd.Stderr = env, logs, logs
	require.NoError(t, cmd.Start())
	e.stopOnCleanup(t, cmd, "producer", logs)
	return cmd
}

// startProcess runs the test binary as a replicator process with its CouchDB at couchURL; extra
// environment entries override the defaults.
func (e *env) startProcess(t testing.TB, couchURL string, logs *syncBuffer, extra ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = e.processEnv(couchURL, append([]string{"SPIEGEL_TEST_AS_REPLICATOR=1", "SPIEGEL_CONCURRENCY=4"}, extra...)...)
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	e.stopOnCleanup(t, cmd, "replicator process", logs)
	return cmd
}

// stopOnCleanup stops cmd (SIGTERM, then SIGKILL after 15s) when the test ends.
func (e *env) stopOnCleanup(t testing.TB, cmd *exec.Cmd, name string, logs *syncBuffer) {
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s logs (tail):\n%s", name, spiegeltest.Tail(logs.String(), 30))
		}
	})
}

// revs returns id → rev of every doc of db.
func revs(t testing.TB, cs *couchtest.Server, db string) map[string]string {
	t.Helper()
	var all struct {
		Rows []struct {
			ID    string `json:"id"`
			Value struct {
				Rev string `json:"rev"`
			} `json:"value"`
		} `json:"rows"`
	}
	if err := cs.Do(t, http.MethodGet, "/"+escapeDBName(db)+"/_all_docs", nil, &all); err != nil {
		return nil
	}
	out := map[string]string{}
	for _, r := range all.Rows {
		out[r.ID] = r.Value.Rev
	}
	return out
}

// waitConverged waits until target holds exactly the docs and revs of source.
func waitConverged(t testing.TB, cs *couchtest.Server, source, target string, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool {
		s, g := revs(t, cs, source), revs(t, cs, target)
		if len(s) == 0 || len(s) != len(g) {
			return false
		}
		for id, rev := range s {
			if g[id] != rev {
				return false
			}
		}
		return true
	}, within, 100*time.Millisecond, "%s did not converge to %s", target, source)
}

// bulkDocs writes n small docs to db in batches of 1000.
func bulkDocs(t testing.TB, cs *couchtest.Server, db string, from, n int) {
	t.Helper()
	for start := from; start < from+n; start += 1000 {
		docs := []map[string]any{}
		for i := start; i < min(start+1000, from+n); i++ {
			docs = append(docs, map[string]any{"_id": fmt.Sprintf("doc%06d", i), "n": i, "pad": "some text to make docs less tiny"})
		}
		require.NoError(t, cs.Do(t, http.MethodPost, "/"+escapeDBName(db)+"/_bulk_docs", map[string]any{"docs": docs}, nil))
	}
}
