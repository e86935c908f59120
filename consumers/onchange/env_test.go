package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// TestMain lets the test binary act as the onchange binary, so crash tests can SIGKILL a real
// onchange process without a separate build step.
func TestMain(m *testing.M) {
	if os.Getenv("SPIEGEL_TEST_AS_ONCHANGE") == "1" {
		main()
		return
	}
	os.Exit(m.Run())
}

// env is one isolated installation: its own NATS server, spiegel db and db-name prefix on the
// shared test CouchDB.
type env struct {
	couch  *couchtest.Server
	nats   *natstest.Server
	js     jetstream.JetStream
	cfg    config.OnChange
	prefix string
	logs   *syncBuffer
}

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

func newEnv(t testing.TB, ackWait time.Duration) *env {
	t.Helper()
	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	topo := natsjs.DefaultTopology("")
	topo.AckWait = ackWait
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	e := &env{couch: cs, nats: ns, js: js, logs: &syncBuffer{}}
	e.prefix = couchtest.UniqueName(t, "oc") + "_"
	cs.CreateDB(t, e.prefix+"spiegel")
	e.cfg = config.OnChange{
		Consumer: config.Consumer{
			CouchDB:     config.CouchDB{CouchDBURL: cs.URL, DBName: e.prefix + "spiegel", CouchDBTimeout: 30 * time.Second},
			NATS:        config.NATS{NATSURL: ns.URL(), SubjectPrefix: "spiegel", StreamReplicas: 1, AckWait: ackWait},
			Log:         config.Log{LogLevel: "debug", LogFormat: "json"},
			Concurrency: 8, ShutdownGrace: 5 * time.Second, RetryInitial: 100 * time.Millisecond, RetryMax: time.Second,
		},
		BatchSize: 100, RequestConcurrency: 10, WebhookTimeout: 5 * time.Second,
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("onchange logs:\n%s", tail(e.logs.String(), 80))
		}
	})
	return e
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (e *env) logger() *logrus.Logger {
	l := logrus.New()
	l.SetOutput(e.logs)
	l.SetLevel(logrus.DebugLevel)
	l.SetFormatter(&logrus.JSONFormatter{})
	return l
}

// start runs an onchange consumer in-process until the test ends; it returns its app, to wait
// for rules to be loaded.
func (e *env) start(t testing.TB) *consumer.App {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cfg := e.cfg
	app, err := consumer.Open(ctx, &cfg.Consumer, events.GroupOnChange, e.logger())
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, cfg.HTTPAddr, newHandler(app.Deps, &cfg).handle) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("onchange did not stop within 30s")
		}
	})
	return app
}

// putRule writes an on_change rule doc (type added) and returns its rev.
func (e *env) putRule(t testing.TB, id string, doc map[string]any) string {
	t.Helper()
	doc["type"] = "on_change"
	return e.couch.Put(t, e.cfg.DBName, id, doc)
}

// waitRule waits until every app has loaded rev of rule id.
func waitRule(t testing.TB, id, rev string, apps ...*consumer.App) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, a := range apps {
			r, ok := a.Rules.Rule(id)
			if !ok || r.Rev() != rev {
				return false
			}
		}
		return true
	}, 10*time.Second, 20*time.Millisecond, "rule %s rev %s not loaded", id, rev)
}

// enqueue publishes an onchange job for db, as the producer would (deduplicated while pending).
func (e *env) enqueue(t testing.TB, db string) {
	t.Helper()
	_, err := natsjs.NewJobs(e.js, events.NewSubjects("")).Publish(t.Context(), events.GroupOnChange, events.Job{DB: db})
	require.NoError(t, err)
}

// checkpoint returns the rule's checkpoint in db ("" and false when there is none).
func (e *env) checkpoint(t testing.TB, rule, db string) (string, bool) {
	var doc checkpoint.OnChange
	err := e.couch.Do(t, "GET", "/"+couchtest.PathDB(e.cfg.DBName)+"/"+url.PathEscape(checkpoint.ID(rule, db)), nil, &doc)
	if err != nil {
		return "", false
	}
	return doc.LastSeq, true
}

// deadLetters returns the records of the dead-letter stream.
func (e *env) deadLetters(t *testing.T) []worker.DeadLetter {
	t.Helper()
	return readStream[worker.DeadLetter](t, e.js, "SPIEGEL_DEADLETTER")
}

// readStream reads every message of stream, decoded as T.
func readStream[T any](t *testing.T, js jetstream.JetStream, stream string) []T {
	t.Helper()
	s, err := js.Stream(t.Context(), stream)
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	var out []T
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(t.Context(), seq)
		if err != nil {
			continue
		}
		var v T
		require.NoError(t, json.Unmarshal(m.Data, &v))
		out = append(out, v)
	}
	return out
}

// hit is one request the sink received.
type hit struct {
	Method, Path, Query string
	Body                map[string]any
	Header              http.Header
	User, Pass          string // basic auth
	Start, End          time.Time
}

// sink is a real local HTTP server that records requests; answer decides each response (nil:
// 200 at once).
type sink struct {
	*httptest.Server
	mu      sync.Mutex
	hits    []hit
	arrived atomic.Int64
	answer  func(h hit, n int) (status int, delay time.Duration)
}

func newSink(t testing.TB, answer func(h hit, n int) (int, time.Duration)) *sink {
	s := &sink{answer: answer}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := hit{Method: r.Method, Path: r.URL.EscapedPath(), Query: r.URL.RawQuery, Header: r.Header.Clone(), Start: time.Now()}
		h.User, h.Pass, _ = r.BasicAuth()
		if b, _ := io.ReadAll(r.Body); len(b) > 0 {
			dec := json.NewDecoder(bytes.NewReader(b))
			dec.UseNumber()
			_ = dec.Decode(&h.Body)
		}
		status, delay := 200, time.Duration(0)
		if s.answer != nil {
			status, delay = s.answer(h, int(s.arrived.Add(1)))
		}
		if delay > 0 {
			time.Sleep(delay)
		}
		h.End = time.Now()
		s.mu.Lock()
		s.hits = append(s.hits, h)
		s.mu.Unlock()
		if status >= 300 && status < 400 {
			w.Header().Set("Location", "/redirected")
		}
		w.WriteHeader(status)
	}))
	t.Cleanup(s.Close)
	return s
}

// all returns the recorded hits (answered requests) in the order they finished.
func (s *sink) all() []hit {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]hit(nil), s.hits...)
}

// waitHits waits until pred holds for the hits.
func (s *sink) waitHits(t testing.TB, within time.Duration, pred func([]hit) bool, msg string) []hit {
	t.Helper()
	var last []hit
	require.Eventually(t, func() bool { last = s.all(); return pred(last) }, within, 20*time.Millisecond, msg)
	return last
}

// param returns a body or query field as text.
func (h hit) param(name string) string {
	if h.Body != nil {
		if v, ok := h.Body[name]; ok {
			if s, ok := v.(string); ok {
				return s
			}
			b, _ := json.Marshal(v)
			return string(b)
		}
	}
	for _, kv := range strings.Split(h.Query, "&") {
		if k, v, ok := strings.Cut(kv, "="); ok && k == name {
			return v
		}
	}
	return ""
}

// deadLettersOf returns the dead-letter records of db.
func (e *env) deadLettersOf(t *testing.T, db string) []worker.DeadLetter {
	var out []worker.DeadLetter
	for _, d := range e.deadLetters(t) {
		if d.DB == db {
			out = append(out, d)
		}
	}
	return out
}

// pendingJobs returns the number of messages in the work stream.
func (e *env) pendingJobs(t *testing.T) uint64 {
	s, err := e.js.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	return info.State.Msgs
}
