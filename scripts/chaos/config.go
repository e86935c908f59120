package chaos

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// Config is one chaos run. Everything the plan contains (writer operations and faults) derives
// from Seed and the sizes below: two runs with the same Config have the same plan.
type Config struct {
	Name string // "short" or "long": names the output dir

	Seed     uint64
	Duration time.Duration // the writer and the faults run this long
	DBs      int           // source dbs
	OpsPerS  float64       // writer operations per second (Poisson arrivals)
	Lanes    int           // writer goroutines; the ops of one db always run in one lane, in plan order

	// Recreate makes the writer recreate the dbs it deletes (CHAOS_RECREATE=0|1); without it a
	// deleted db stays deleted.
	Recreate bool
	// QuickRecreatePct is the percentage of db recreations planned less than a second after the
	// deletion (within one poll round of the producer); the others come 1–20s later.
	QuickRecreatePct int

	// FaultEvery is the mean gap between faults; the first faults are one of every class.
	FaultEvery time.Duration
	// AckWait is SPIEGEL_ACK_WAIT of every process; a SIGSTOP lasts longer than it.
	AckWait time.Duration
	// QuiesceTimeout bounds the wait, after the last fault, for everything to converge.
	QuiesceTimeout time.Duration
	// HealLimit, when set, fails the run if a fault class takes longer to heal (see heal.go);
	// every run reports its time to heal per class.
	HealLimit time.Duration

	// SinkFail and SinkStall are the fractions of webhook requests the sink answers 500, or
	// answers only after the rule's timeout, outside fault periods.
	SinkFail, SinkStall float64

	// CouchURL names any CouchDB to run against (CHAOS_COUCHDB_URL); empty: the run starts its
	// own PouchDB Server on disk, which the CouchDB-restart fault restarts.
	CouchURL string
	// CouchRestartCmd restarts the server at CouchURL (CHAOS_COUCHDB_RESTART_CMD, run with
	// sh -c); empty: the CouchDB-restart fault is an outage of the proxy between the Spiegel
	// processes and the server at CouchURL, which is never restarted (outage.go).
	CouchRestartCmd string
	// CouchNodeCmd kills and starts one node of a CouchDB cluster (CHAOS_COUCHDB_NODE_CMD, run
	// with sh -c, CHAOS_NODE_ACTION=kill|start and CHAOS_NODE=<1-based index in the URL list> in
	// its environment). With it, and CHAOS_COUCHDB_URL listing the cluster's nodes, the plan gets
	// the kill-couchdb-node fault; the run's own requests go to the last node, which that fault
	// never kills.
	CouchNodeCmd string
	// CouchNodes is how many nodes CHAOS_COUCHDB_URL lists (0 or 1: one server).
	CouchNodes int
	// Q is the shard count of the source dbs on Apache CouchDB: 1 (default) gives each db one
	// total feed order, which the change-stream oracle checks.
	Q int

	Root   string // repository root: bin/ and scripts/pouchdb live there
	OutDir string // logs, the plan, the summary, data dirs of the servers
	Keep   bool   // keep OutDir after a passing run (CHAOS_KEEP=1)

	// SkipFaults names fault classes (FaultKind names, CHAOS_SKIP_FAULTS, comma-separated) that
	// stay in the plan but are not run: the plan, and so the replay, is the same.
	SkipFaults map[string]bool

	// Partitions adds the network-partition faults, partition-nats and partition-couchdb, to the
	// plan (CHAOS_PARTITIONS=1; off by default in the short and the long run) and only then puts
	// each product process behind its own proxies to NATS and CouchDB (links.go); without it the
	// processes connect directly and the plan is the one of a run without these faults. Off by
	// default so that the default runs keep their plans; the change stream's publishes are
	// fenced against a frozen instance now.
	Partitions bool

	// StoreLoss adds the NATS storage-loss faults, nats-store-loss and nats-store-loss-all, to
	// the plan (CHAOS_STORE_LOSS=1; off by default in the short and the long run). Off by default
	// because a node restarted from a store copied file by file can come back with a hole, which
	// JetStream did not fill from the other replicas while the runs went on: the replicas of a
	// stream then hold different messages at the same sequences, and each new leader shows its
	// own history.
	// The rules heal what the leader shows them (holes in a subject, a mirror's lost writes), but
	// a later leader can show another replica's history, which runs with these faults have
	// failed on (read back from their stores).
	StoreLoss bool

	// LogLevel is SPIEGEL_LOG_LEVEL of the product processes (CHAOS_LOG_LEVEL, default info).
	LogLevel string

	// Strict fails the run on what it otherwise reports as known defects and accounts for
	// (CHAOS_STRICT=1): processes exiting while they start, dead letters of dbs deleted during
	// their replication, change-stream order broken during a NATS node's outage.
	Strict bool
}

// shortConfig is the fixed-seed run of the test command: about a minute, every fault class,
// two db recreations.
func shortConfig(root string) Config {
	return Config{
		Name: "short", Seed: 20260611, Duration: 32 * time.Second, DBs: 16, OpsPerS: 10, Lanes: 3, Recreate: true,
		FaultEvery: 2500 * time.Millisecond, AckWait: 4 * time.Second, QuiesceTimeout: 60 * time.Second,
		SinkFail: 0.02, SinkStall: 0.005, Q: 1, Root: root,
	}
}

// longConfig is `make chaos`: SEED and DURATION from the environment (CHAOS_SEED,
// CHAOS_DURATION; a missing seed is drawn from the clock and printed), 200 dbs.
func longConfig(root string) (Config, error) {
	c := Config{
		Name: "long", Duration: 30 * time.Minute, DBs: 200, OpsPerS: 14, Lanes: 6, Recreate: true, QuickRecreatePct: 30,
		FaultEvery: 12 * time.Second, AckWait: 5 * time.Second, QuiesceTimeout: 5 * time.Minute, HealLimit: time.Minute,
		SinkFail: 0.02, SinkStall: 0.005, Q: 1, Root: root,
	}
	c.Seed = uint64(time.Now().UnixNano() % 1_000_000)
	if v := os.Getenv("CHAOS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return c, fmt.Errorf("CHAOS_SEED: %q is not a non-negative integer", v)
		}
		c.Seed = s
	}
	if v := os.Getenv("CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 20*time.Second {
			return c, fmt.Errorf("CHAOS_DURATION: %q is not a duration of at least 20s", v)
		}
		c.Duration = d
	}
	if v := os.Getenv("CHAOS_DBS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return c, fmt.Errorf("CHAOS_DBS: %q is not a positive integer", v)
		}
		c.DBs = n
	}
	return c, nil
}

// fromEnv applies the variables every run honours: the server (CHAOS_COUCHDB_URL,
// CHAOS_COUCHDB_RESTART_CMD, CHAOS_COUCHDB_NODE_CMD, CHAOS_Q), the sink's baseline fractions (CHAOS_SINK_FAIL,
// CHAOS_SINK_STALL), CHAOS_RECREATE and CHAOS_QUICK_RECREATE (plan), CHAOS_SKIP_FAULTS,
// CHAOS_PARTITIONS and CHAOS_STORE_LOSS (plan), CHAOS_LOG_LEVEL, the output dir (CHAOS_OUT),
// CHAOS_KEEP and CHAOS_STRICT.
func (c *Config) fromEnv() error {
	c.CouchURL = os.Getenv("CHAOS_COUCHDB_URL")
	c.CouchRestartCmd = os.Getenv("CHAOS_COUCHDB_RESTART_CMD")
	c.CouchNodeCmd = os.Getenv("CHAOS_COUCHDB_NODE_CMD")
	if c.CouchURL != "" {
		c.CouchNodes = len(couch.SplitURLs(c.CouchURL))
	}
	if c.CouchNodeCmd != "" && c.CouchNodes < 2 {
		return errors.New("CHAOS_COUCHDB_NODE_CMD needs CHAOS_COUCHDB_URL to list the cluster's nodes (comma-separated)")
	}
	for _, f := range []struct {
		name string
		dst  *float64
	}{{"CHAOS_SINK_FAIL", &c.SinkFail}, {"CHAOS_SINK_STALL", &c.SinkStall}} {
		if v := os.Getenv(f.name); v != "" {
			x, err := strconv.ParseFloat(v, 64)
			if err != nil || x < 0 || x > 0.5 {
				return fmt.Errorf("%s: %q is not a fraction between 0 and 0.5", f.name, v)
			}
			*f.dst = x
		}
	}
	if v := os.Getenv("CHAOS_Q"); v != "" {
		q, err := strconv.Atoi(v)
		if err != nil || q < 1 {
			return fmt.Errorf("CHAOS_Q: %q is not a positive integer", v)
		}
		c.Q = q
	}
	c.Keep = os.Getenv("CHAOS_KEEP") == "1"
	c.Strict = os.Getenv("CHAOS_STRICT") == "1"
	c.SkipFaults = map[string]bool{}
	for _, name := range strings.Split(os.Getenv("CHAOS_SKIP_FAULTS"), ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if !slices.Contains(faultNames[:], name) {
			return fmt.Errorf("CHAOS_SKIP_FAULTS: %q is not one of %v", name, faultNames)
		}
		c.SkipFaults[name] = true
	}
	for _, opt := range []struct {
		name string
		on   *bool
	}{{"CHAOS_PARTITIONS", &c.Partitions}, {"CHAOS_STORE_LOSS", &c.StoreLoss}} {
		switch v := os.Getenv(opt.name); v {
		case "":
		case "0", "1":
			*opt.on = v == "1"
		default:
			return fmt.Errorf("%s: %q is not 0 or 1", opt.name, v)
		}
	}
	c.LogLevel = os.Getenv("CHAOS_LOG_LEVEL")
	if c.LogLevel == "" {
		c.LogLevel = "info"
	}
	if v := os.Getenv("CHAOS_RECREATE"); v != "" {
		c.Recreate = v == "1"
	}
	if v := os.Getenv("CHAOS_QUICK_RECREATE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > 100 {
			return fmt.Errorf("CHAOS_QUICK_RECREATE: %q is not a percentage", v)
		}
		c.QuickRecreatePct = n
	}
	base := os.Getenv("CHAOS_OUT")
	if base == "" {
		base = filepath.Join(c.Root, ".chaos") // not .run: the run command removes that at its start
	}
	c.OutDir = filepath.Join(base, fmt.Sprintf("%s-seed%d-%s", c.Name, c.Seed, time.Now().Format("20060102-150405")))
	return nil
}
