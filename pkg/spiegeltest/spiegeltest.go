// Package spiegeltest gives the tests of the producer and both consumers one isolated Spiegel
// installation each: the shared test CouchDB (couchtest), an embedded NATS server of its own
// (natstest), a db-name prefix unique to the test, a spiegel db, the work-stream topology, a log
// buffer whose tail is printed when the test fails, and the helpers every package's tests use
// on them (jobs in the work stream, dead letters, stream contents).
package spiegeltest

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// Env is one installation. Its fields are set by New and read by tests.
type Env struct {
	Couch  *couchtest.Server
	NATS   *natstest.Server
	JS     jetstream.JetStream
	Prefix string // every db of the test starts with it; the spiegel db is Prefix + "spiegel"
	Logs   *logtest.Buffer
}

// Options tune New.
type Options struct {
	// Name starts the prefix ("p" for the producer's tests, ...).
	Name string
	// Couch is the CouchDB to use; nil: couchtest.Get.
	Couch *couchtest.Server
	// AckWait of the work consumers Topology creates (see Topology); 0: 60s.
	AckWait time.Duration
	// Install creates the streams, the consumers and the spiegel db as `producer install`
	// would; tests that run install themselves leave it false.
	Install bool
}

// New starts an installation for t; everything is removed when t ends.
func New(t testing.TB, o Options) *Env {
	t.Helper()
	if o.Couch == nil {
		o.Couch = couchtest.Get(t)
	}
	if o.AckWait == 0 {
		o.AckWait = 60 * time.Second
	}
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	e := &Env{Couch: o.Couch, NATS: ns, JS: js, Prefix: couchtest.UniqueName(t, o.Name) + "_", Logs: &logtest.Buffer{}}
	// Every db of the installation is named with Prefix: the spiegel db, the test's dbs and the
	// ones its pipeline creates (replication targets). Registered first, this runs last, after
	// the test's processes stopped, also when the test failed.
	o.Couch.CleanupPrefix(t, e.Prefix)
	if o.Install {
		topo := natsjs.DefaultTopology("")
		topo.AckWait = o.AckWait
		require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
		o.Couch.CreateDB(t, e.SpiegelDB())
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s logs (tail):\n%s", o.Name, Tail(e.Logs.String(), 60))
		}
	})
	return e
}

// SpiegelDB is the name of the installation's spiegel db.
func (e *Env) SpiegelDB() string { return e.Prefix + "spiegel" }

// CouchDBConfig, NATSConfig and LogConfig are the installation's configuration parts, as every
// binary's config embeds them.
func (e *Env) CouchDBConfig() config.CouchDB {
	return config.CouchDB{CouchDBURL: e.Couch.URL, DBName: e.SpiegelDB(), CouchDBTimeout: 30 * time.Second}
}

// NATSConfig: see CouchDBConfig.
func (e *Env) NATSConfig(ackWait time.Duration) config.NATS {
	return config.NATS{NATSURL: e.NATS.URL(), SubjectPrefix: "spiegel", StreamReplicas: 1, AckWait: ackWait}
}

// LogConfig: see CouchDBConfig.
func (e *Env) LogConfig() config.Log { return config.Log{LogLevel: "debug", LogFormat: "json"} }

// Logger returns a debug-level JSON logger writing into Logs.
func (e *Env) Logger() *logrus.Logger {
	l := logrus.New()
	l.SetOutput(e.Logs)
	l.SetLevel(logrus.DebugLevel)
	l.SetFormatter(&logrus.JSONFormatter{})
	return l
}

// Tail returns the last n lines of s.
func Tail(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Enqueue offers a job of group g for db as the producer does: deduplicated while one is
// pending or running, then with its wakeup marker (natsjs.Jobs.Offer).
func (e *Env) Enqueue(t testing.TB, g events.Group, db string) {
	t.Helper()
	_, err := natsjs.NewJobs(e.JS, events.NewSubjects("")).Offer(t.Context(), g, events.Job{DB: db})
	require.NoError(t, err)
}

// Pending returns the number of messages per work subject (pending or in flight).
func (e *Env) Pending(t testing.TB) map[string]uint64 {
	t.Helper()
	s, err := e.JS.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err)
	info, err := s.Info(t.Context(), jetstream.WithSubjectFilter("spiegel.work.>"))
	require.NoError(t, err)
	out := map[string]uint64{}
	for k, v := range info.State.Subjects {
		out[k] = v
	}
	return out
}

// WorkMsgs returns the number of messages of the work stream (pending or in flight).
func (e *Env) WorkMsgs(t testing.TB) uint64 {
	t.Helper()
	s, err := e.JS.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	return info.State.Msgs
}

// Purge empties the work stream.
func (e *Env) Purge(t testing.TB) {
	t.Helper()
	s, err := e.JS.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err)
	require.NoError(t, s.Purge(t.Context()))
}

// DeadLetters returns the records of the dead-letter stream, oldest first.
func (e *Env) DeadLetters(t testing.TB) []worker.DeadLetter {
	t.Helper()
	return ReadStream[worker.DeadLetter](t, e.JS, "SPIEGEL_DEADLETTER")
}

// ReadStream reads every message of stream, oldest first, decoded as T.
func ReadStream[T any](t testing.TB, js jetstream.JetStream, stream string) []T {
	t.Helper()
	s, err := js.Stream(t.Context(), stream)
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	var out []T
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(t.Context(), seq)
		if err != nil {
			continue // deleted
		}
		var v T
		require.NoError(t, json.Unmarshal(m.Data, &v))
		out = append(out, v)
	}
	return out
}
