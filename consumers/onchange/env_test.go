package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// TestMain lets the test binary act as the onchange binary, so crash tests can SIGKILL a real
// onchange process without a separate build step. Tests skipped for want of a CouchDB are
// reported in one line (couchtest.Main).
func TestMain(m *testing.M) {
	if os.Getenv("SPIEGEL_TEST_AS_ONCHANGE") == "1" {
		main()
		return
	}
	os.Exit(couchtest.Main(m))
}

// env is one isolated installation (spiegeltest) with an onchange configuration.
type env struct {
	*spiegeltest.Env
	cfg config.OnChange
}

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

func newEnv(t testing.TB, ackWait time.Duration) *env {
	t.Helper()
	e := &env{Env: spiegeltest.New(t, spiegeltest.Options{Name: "oc", AckWait: ackWait, Install: true})}
	e.cfg = config.OnChange{
		Consumer: config.Consumer{
			CouchDB: e.CouchDBConfig(), NATS: e.NATSConfig(ackWait), Log: e.LogConfig(),
			Concurrency: 8, ShutdownGrace: 5 * time.Second, RetryInitial: 100 * time.Millisecond, RetryMax: time.Second,
		},
		BatchSize: 100, RequestConcurrency: 10, WebhookTimeout: 5 * time.Second,
		AllowedHosts: []string{"127.0.0.1"}, // the tests' receivers: loopback is refused by default
	}
	return e
}

// start runs an onchange consumer in-process until the test ends; it returns its app, to wait
// for rules to be loaded.
func (e *env) start(t testing.TB) *consumer.App {
	t.Helper()
	app, _ := e.startStoppable(t)
	return app
}

// startStoppable runs an onchange consumer in-process until stop is called or the test ends;
// stop waits for it.
func (e *env) startStoppable(t testing.TB) (app *consumer.App, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cfg := e.cfg
	app, err := open(ctx, &cfg, e.Logger())
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, cfg.HTTPAddr, newHandler(app.Deps, &cfg).handle) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Error("onchange did not stop within 30s")
			}
		})
	}
	t.Cleanup(stop)
	return app, stop
}

// putRule writes an on_change rule doc (type added) and returns its rev.
func (e *env) putRule(t testing.TB, id string, doc map[string]any) string {
	t.Helper()
	doc["type"] = "on_change"
	return e.Couch.Put(t, e.cfg.DBName, id, doc)
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
func (e *env) enqueue(t testing.TB, db string) { e.Enqueue(t, events.GroupOnChange, db) }

// checkpoint returns the rule's checkpoint in db ("" and false when there is none) as a job
// reads it: from the cache, else from the _local doc (which may trail the cache, see
// checkpoint.OnChangeStore.LocalEvery).
func (e *env) checkpoint(t testing.TB, rule, db string) (string, bool) {
	t.Helper()
	p, err := e.onChangeStore(t).Load(t.Context(), rule, db)
	if err != nil {
		return "", false
	}
	return p.LastSeq, p.Found
}

// onChangeStore returns a checkpoint store over the env's server and cache.
func (e *env) onChangeStore(t testing.TB) *checkpoint.OnChangeStore {
	t.Helper()
	c, err := couch.New(couch.Config{URL: e.Couch.URL}, nil)
	require.NoError(t, err)
	kv, err := natsjs.OnChangeBucket(t.Context(), e.JS, natsjs.DefaultTopology(""))
	require.NoError(t, err)
	return checkpoint.NewOnChangeStore(c, kv)
}

// replay resets rule's checkpoint in db to the beginning, as `producer replay` does.
func (e *env) replay(t testing.TB, rule, db string) {
	t.Helper()
	require.NoError(t, e.onChangeStore(t).Reset(t.Context(), rule, db, ""))
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
	for _, d := range e.DeadLetters(t) {
		if d.DB == db {
			out = append(out, d)
		}
	}
	return out
}
