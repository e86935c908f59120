package chaos

import (
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"testing"
)

// TestChaosShort is the fixed-seed chaos run of the test command (about a minute): every fault
// class once or more, 16 dbs. Its output dir is removed when it passes.
func TestChaosShort(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos run starts a NATS cluster, CouchDB and six processes")
	}
	root := repoRoot(t)
	cfg := shortConfig(root)
	if err := cfg.fromEnv(); err != nil {
		t.Fatal(err)
	}
	runChaos(t, cfg)
}

// TestChaosLong is `make chaos SEED=n DURATION=d`: it runs only with CHAOS_LONG=1, which the
// make target sets.
func TestChaosLong(t *testing.T) {
	if os.Getenv("CHAOS_LONG") != "1" {
		t.Skip("the long chaos run: make chaos SEED=<n> DURATION=<d>")
	}
	root := repoRoot(t)
	cfg, err := longConfig(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.fromEnv(); err != nil {
		t.Fatal(err)
	}
	runChaos(t, cfg)
}

// runChaos executes cfg, printing progress and the result to the test's output, and fails the
// test unless the run passed. SIGINT and SIGTERM end the run early, with the usual shutdown.
func runChaos(t *testing.T, cfg Config) {
	if cfg.CouchURL == "" {
		for _, tool := range []string{"node", "npm"} {
			if _, err := exec.LookPath(tool); err != nil {
				if os.Getenv("SPIEGEL_REQUIRE_COUCHDB") != "" {
					t.Fatalf("%s is missing: the chaos run starts its own PouchDB Server (or set CHAOS_COUCHDB_URL)", tool)
				}
				t.Skipf("%s is missing: the chaos run starts its own PouchDB Server (or set CHAOS_COUCHDB_URL)", tool)
			}
		}
	}
	ctx, stop := signal.NotifyContext(t.Context(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	res := execute(ctx, cfg, t.Output())
	if !res.Pass() {
		t.Fatalf("chaos run failed — SEED %d; replay: %s; output in %s", cfg.Seed, res.replay(), cfg.OutDir)
	}
}

// repoRoot returns the repository root (this package is scripts/chaos) and skips the test when a
// binary of bin/ is missing: the test command builds them with `make build` before `go test`.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatalf("repo root: %v", err)
	}
	for _, b := range []string{"producer", "replicator", "onchange", "nats-server"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Skipf("bin/%s is missing: the test command builds it (make build)", b)
		}
	}
	return root
}
