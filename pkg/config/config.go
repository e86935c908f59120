// Package config holds the configuration of the three binaries: one envconfig struct per binary,
// built from shared parts, every variable with a default and a one-line description. Only main
// packages load it.
package config

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Version is set at build time with -ldflags "-X .../pkg/config.Version=...".
var Version = "dev"

// CouchDB says how to reach the watched server and where the rules live.
type CouchDB struct {
	CouchDBURL         string        `envconfig:"SPIEGEL_COUCHDB_URL" required:"true" desc:"the watched CouchDB, with admin credentials (http://user:password@host:5984); the nodes of one cluster may be listed, comma-separated: the first is used until it cannot be reached, then the next" group:"CouchDB"`
	DBName             string        `envconfig:"SPIEGEL_DB_NAME" default:"spiegel" desc:"the spiegel db: rules and checkpoints" group:"CouchDB"`
	CouchDBCAFile      string        `envconfig:"SPIEGEL_COUCHDB_CA_FILE" desc:"PEM file of CAs to trust for an https CouchDB (default: system roots)" group:"CouchDB"`
	CouchDBInsecureTLS bool          `envconfig:"SPIEGEL_COUCHDB_INSECURE_SKIP_VERIFY" default:"false" desc:"skip TLS certificate verification of CouchDB (testing only)" group:"CouchDB" advanced:"true"`
	CouchDBTimeout     time.Duration `envconfig:"SPIEGEL_COUCHDB_TIMEOUT" default:"30s" desc:"timeout of one CouchDB request (feeds excepted)" group:"CouchDB" advanced:"true"`
	CouchDBMaxConns    MaxConns      `envconfig:"SPIEGEL_COUCHDB_MAX_CONNECTIONS" default:"auto" desc:"most connections one process opens to a CouchDB host for requests; more requests at once wait for one. Continuous feeds come on top. auto: half of SPIEGEL_CONCURRENCY, at least 4 (the producer, whose requests are few at a time: no cap); 0: no cap" group:"CouchDB" advanced:"true"`
}

// MaxConns is SPIEGEL_COUCHDB_MAX_CONNECTIONS: a number, or "auto" (AutoConns).
type MaxConns int

// AutoConns is MaxConns' "auto": the process picks its cap (see For).
const AutoConns MaxConns = -1

// Decode implements envconfig.Decoder.
func (m *MaxConns) Decode(v string) error {
	v = strings.TrimSpace(v)
	if v == "" || strings.EqualFold(v, "auto") {
		*m = AutoConns
		return nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return fmt.Errorf("want auto or a number of connections, not %q", v)
	}
	*m = MaxConns(n)
	return nil
}

// For returns the cap of a process running concurrency jobs at once (0: no cap): auto gives half
// of them, at least 4. A consumer's jobs wait on CouchDB and NATS by turns, and CouchDB serves
// few requests at once on its cores (BenchmarkConnections: 8 per process cost no speed), while
// connections per process times processes is what CouchDB holds open.
func (m MaxConns) For(concurrency int) int { return m.Or(max(4, concurrency/2)) }

// Or returns auto for "auto", else the number set.
func (m MaxConns) Or(auto int) int {
	if m == AutoConns {
		return auto
	}
	return int(m)
}

// NATS says how to reach NATS and how the JetStream topology is named.
type NATS struct {
	NATSURL          string        `envconfig:"SPIEGEL_NATS_URL" default:"nats://127.0.0.1:4222" desc:"NATS server URL(s), comma-separated" group:"NATS"`
	SubjectPrefix    string        `envconfig:"SPIEGEL_SUBJECT_PREFIX" default:"spiegel" desc:"subject prefix; stream names derive from it (SPIEGEL_WORK, ...)" group:"NATS"`
	NATSCredsFile    string        `envconfig:"SPIEGEL_NATS_CREDS_FILE" desc:"NATS credentials (JWT) file" group:"NATS"`
	NATSNKeySeedFile string        `envconfig:"SPIEGEL_NATS_NKEY_SEED_FILE" desc:"NATS nkey seed file" group:"NATS"`
	NATSUser         string        `envconfig:"SPIEGEL_NATS_USER" desc:"NATS user" group:"NATS"`
	NATSPassword     string        `envconfig:"SPIEGEL_NATS_PASSWORD" desc:"NATS password (never logged)" group:"NATS" secret:"true"`
	NATSToken        string        `envconfig:"SPIEGEL_NATS_TOKEN" desc:"NATS token (never logged)" group:"NATS" secret:"true"`
	NATSCAFile       string        `envconfig:"SPIEGEL_NATS_CA_FILE" desc:"PEM file of CAs to trust for NATS TLS" group:"NATS"`
	NATSCertFile     string        `envconfig:"SPIEGEL_NATS_CERT_FILE" desc:"client certificate for NATS TLS" group:"NATS"`
	NATSKeyFile      string        `envconfig:"SPIEGEL_NATS_KEY_FILE" desc:"client key for NATS TLS" group:"NATS"`
	StreamReplicas   int           `envconfig:"SPIEGEL_STREAM_REPLICAS" default:"1" desc:"replicas of the streams install creates and of the mirror buckets onchange creates (3 on a NATS cluster)" group:"NATS"`
	AckWait          time.Duration `envconfig:"SPIEGEL_ACK_WAIT" default:"60s" desc:"JetStream AckWait for work jobs: a dead worker's job is redelivered after it" group:"Jobs"`
}

// Log configures logging.
type Log struct {
	LogLevel  string `envconfig:"SPIEGEL_LOG_LEVEL" default:"info" desc:"debug|info|warn|error" group:"Logging"`
	LogFormat string `envconfig:"SPIEGEL_LOG_FORMAT" default:"json" desc:"json|text" group:"Logging"`
}

// Debug holds what an operator turns on to look inside a running process.
type Debug struct {
	PprofAddr string `envconfig:"SPIEGEL_PPROF_ADDR" desc:"listener of Go's profiling endpoints (/debug/pprof/), for CPU and heap profiles of the running process (empty: off); they have no authentication: bind it to loopback (127.0.0.1:6060)" group:"Process" advanced:"true"`
}

// Producer is the configuration of the producer binary and its admin commands.
type Producer struct {
	CouchDB
	NATS
	Log
	Debug
	HTTPAddr             string        `envconfig:"SPIEGEL_HTTP_ADDR" default:":8080" desc:"health and metrics listener (empty: off)" group:"Process"`
	Source               string        `envconfig:"SPIEGEL_SOURCE" default:"auto" desc:"feed source: auto|db_updates|global_changes|poll" group:"Feed"`
	Start                string        `envconfig:"SPIEGEL_START" default:"beginning" desc:"beginning|now, where a producer with no saved position starts; both now act the same: at the server's current position, and once the feed runs every rule's catch-up enqueues each db it matches, so nothing written before is missed" group:"Feed"`
	FeedHeartbeat        time.Duration `envconfig:"SPIEGEL_FEED_HEARTBEAT" default:"10s" desc:"heartbeat asked of continuous feeds; no byte for twice this reopens the feed" group:"Feed" advanced:"true"`
	PollInterval         time.Duration `envconfig:"SPIEGEL_POLL_INTERVAL" default:"2s" desc:"how often the poll source lists dbs and their update_seq" group:"Feed" advanced:"true"`
	SweepInterval        time.Duration `envconfig:"SPIEGEL_SWEEP_INTERVAL" default:"10m" desc:"reconciliation sweep period, the first at start: enqueues every matched db not recorded done at its update_seq, reading the dbs' infos 100 at a time, at most 2 requests a second, spread over up to a tenth of the period (at most 1m), and asking CouchDB about at most 50 dbs a second whose record reads as another seq string (0: off)" group:"Feed" advanced:"true"`
	PositionSaveInterval time.Duration `envconfig:"SPIEGEL_POSITION_SAVE_INTERVAL" default:"2s" desc:"how often the feed position is saved" group:"Feed" advanced:"true"`
	MaxInflight          int           `envconfig:"SPIEGEL_PUBLISH_MAX_INFLIGHT" default:"4096" desc:"job publishes awaiting JetStream's ack at once" group:"Feed" advanced:"true"`
	HotFeeds             int           `envconfig:"SPIEGEL_HOT_FEEDS" default:"32" desc:"most continuous _changes feeds kept open on busy dbs, whose jobs are published the moment they change (0: off)" group:"Feed" advanced:"true"`
	HotFeedIdle          time.Duration `envconfig:"SPIEGEL_HOT_FEED_IDLE" default:"20s" desc:"a db whose db-updates events come three in a row (up to eight while feeds do not pay), each within this long of the one before, earns a hot feed; a hot feed without a change for this long is closed" group:"Feed" advanced:"true"`
	ShutdownGrace        time.Duration `envconfig:"SPIEGEL_SHUTDOWN_GRACE" default:"10s" desc:"time allowed on SIGTERM to flush publishes and save the position" group:"Process" advanced:"true"`
	AdminTimeout         time.Duration `envconfig:"SPIEGEL_ADMIN_TIMEOUT" default:"15s" desc:"how long admin commands wait for CouchDB and NATS before giving up (also --timeout)" group:"Admin commands"`
	ChangesMaxAge        time.Duration `envconfig:"SPIEGEL_CHANGES_MAX_AGE" default:"168h" desc:"how long the change stream (SPIEGEL_CHANGES) that install creates keeps a change (0: forever); an existing stream keeps its own until install --update" group:"Install"`
	DeadLetterMaxAge     time.Duration `envconfig:"SPIEGEL_DEADLETTER_MAX_AGE" default:"720h" desc:"how long the dead-letter stream that install creates keeps a record (0: forever); an existing stream keeps its own until install --update" group:"Install"`
	MaxAckPending        int           `envconfig:"SPIEGEL_MAX_ACK_PENDING" default:"1000" desc:"jobs a work consumer that install creates hands out and has not had acknowledged, per group (all its processes together); an existing consumer keeps its own until install --update" group:"Install" advanced:"true"`
}

// Validate checks what envconfig cannot.
func (c *Producer) Validate() error {
	var errs []error
	errs = append(errs, c.CouchDB.validate(), c.NATS.validate(), c.Log.validate())
	switch c.Source {
	case "auto", "db_updates", "global_changes", "poll":
	default:
		errs = append(errs, fmt.Errorf("SPIEGEL_SOURCE=%q: want auto, db_updates, global_changes or poll", c.Source))
	}
	switch c.Start {
	case "beginning", "now":
	default:
		errs = append(errs, fmt.Errorf("SPIEGEL_START=%q: want beginning or now", c.Start))
	}
	errs = append(errs,
		positive("SPIEGEL_FEED_HEARTBEAT", c.FeedHeartbeat),
		positive("SPIEGEL_POLL_INTERVAL", c.PollInterval),
		positive("SPIEGEL_POSITION_SAVE_INTERVAL", c.PositionSaveInterval),
		positive("SPIEGEL_SHUTDOWN_GRACE", c.ShutdownGrace),
		positive("SPIEGEL_HOT_FEED_IDLE", c.HotFeedIdle),
		positive("SPIEGEL_ADMIN_TIMEOUT", c.AdminTimeout))
	if c.HotFeeds < 0 {
		errs = append(errs, fmt.Errorf("SPIEGEL_HOT_FEEDS=%d: must not be negative", c.HotFeeds))
	}
	if c.SweepInterval < 0 {
		errs = append(errs, fmt.Errorf("SPIEGEL_SWEEP_INTERVAL=%s: must not be negative", c.SweepInterval))
	}
	errs = append(errs, maxAge("SPIEGEL_CHANGES_MAX_AGE", c.ChangesMaxAge), maxAge("SPIEGEL_DEADLETTER_MAX_AGE", c.DeadLetterMaxAge))
	if c.MaxAckPending < 1 {
		errs = append(errs, fmt.Errorf("SPIEGEL_MAX_ACK_PENDING=%d: must be at least 1", c.MaxAckPending))
	}
	if c.MaxInflight < 1 {
		errs = append(errs, fmt.Errorf("SPIEGEL_PUBLISH_MAX_INFLIGHT=%d: must be at least 1", c.MaxInflight))
	}
	return errors.Join(errs...)
}

func (c *CouchDB) validate() error {
	var errs []error
	if !strings.HasPrefix(c.CouchDBURL, "http://") && !strings.HasPrefix(c.CouchDBURL, "https://") {
		errs = append(errs, errors.New("SPIEGEL_COUCHDB_URL: want an http:// or https:// URL"))
	}
	if c.DBName == "" || strings.HasPrefix(c.DBName, "_") {
		errs = append(errs, fmt.Errorf("SPIEGEL_DB_NAME=%q: want a plain db name", c.DBName))
	}
	if c.CouchDBCAFile != "" {
		if _, err := os.Stat(c.CouchDBCAFile); err != nil {
			errs = append(errs, fmt.Errorf("SPIEGEL_COUCHDB_CA_FILE: %w", err))
		}
	}
	errs = append(errs, positive("SPIEGEL_COUCHDB_TIMEOUT", c.CouchDBTimeout))
	if (c.CouchDBMaxConns < 0 && c.CouchDBMaxConns != AutoConns) || c.CouchDBMaxConns > 10000 {
		errs = append(errs, fmt.Errorf("SPIEGEL_COUCHDB_MAX_CONNECTIONS=%d: want auto, 0 (no cap) or up to 10000", c.CouchDBMaxConns))
	}
	return errors.Join(errs...)
}

func (c *NATS) validate() error {
	var errs []error
	if strings.TrimSpace(c.NATSURL) == "" {
		errs = append(errs, errors.New("SPIEGEL_NATS_URL: must not be empty"))
	}
	if c.SubjectPrefix == "" || strings.ContainsAny(c.SubjectPrefix, " *>\t") || strings.HasPrefix(c.SubjectPrefix, ".") ||
		strings.HasSuffix(c.SubjectPrefix, ".") || strings.Contains(c.SubjectPrefix, "..") {
		errs = append(errs, fmt.Errorf("SPIEGEL_SUBJECT_PREFIX=%q: want one or more NATS subject tokens without wildcards", c.SubjectPrefix))
	}
	if c.StreamReplicas < 1 || c.StreamReplicas > 5 {
		errs = append(errs, fmt.Errorf("SPIEGEL_STREAM_REPLICAS=%d: want 1 to 5", c.StreamReplicas))
	}
	if (c.NATSCertFile == "") != (c.NATSKeyFile == "") {
		errs = append(errs, errors.New("SPIEGEL_NATS_CERT_FILE and SPIEGEL_NATS_KEY_FILE: set both or neither"))
	}
	if c.AckWait < time.Second {
		errs = append(errs, fmt.Errorf("SPIEGEL_ACK_WAIT=%s: must be at least 1s", c.AckWait))
	}
	return errors.Join(errs...)
}

func (c *Log) validate() error {
	var errs []error
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, fmt.Errorf("SPIEGEL_LOG_LEVEL=%q: want debug, info, warn or error", c.LogLevel))
	}
	switch c.LogFormat {
	case "json", "text":
	default:
		errs = append(errs, fmt.Errorf("SPIEGEL_LOG_FORMAT=%q: want json or text", c.LogFormat))
	}
	return errors.Join(errs...)
}

// maxAge checks the age after which a stream drops a message: 0 (never) or at least a second
// (JetStream refuses less than 100ms).
func maxAge(name string, d time.Duration) error {
	if d < 0 || d > 0 && d < time.Second {
		return fmt.Errorf("%s=%s: want 0 (forever) or at least 1s", name, d)
	}
	return nil
}

func positive(name string, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("%s=%s: must be positive", name, d)
	}
	return nil
}

// Load fills spec from the environment and runs its Validate method. Errors name the variable.
func Load(spec interface{ Validate() error }) error {
	if err := process(spec); err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	if err := spec.Validate(); err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	return nil
}
