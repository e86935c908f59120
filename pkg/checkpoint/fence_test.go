package checkpoint

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// fenceEnv is a watched db, a cache bucket, and CouchDB behind a proxy the test controls.
type fenceEnv struct {
	srv   *couchtest.Server
	db    string
	kv    jetstream.KeyValue
	proxy *localProxy
}

func newFenceEnv(t *testing.T) *fenceEnv {
	t.Helper()
	srv := couchtest.Get(t)
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	topo := natsjs.DefaultTopology("")
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	kv, err := natsjs.OnChangeBucket(t.Context(), js, topo)
	require.NoError(t, err)
	return &fenceEnv{srv: srv, db: srv.NewDB(t, "fence_"), kv: kv, proxy: newLocalProxy(t, srv.URL)}
}

// store returns a store (one consumer process) talking to CouchDB directly, with kv as its cache.
func (e *fenceEnv) store(t *testing.T, kv jetstream.KeyValue) *OnChangeStore {
	return NewOnChangeStore(client(t, e.srv.URL, 0), kv)
}

// proxied returns a store whose CouchDB requests go through the proxy.
func (e *fenceEnv) proxied(t *testing.T, kv jetstream.KeyValue) *OnChangeStore {
	return NewOnChangeStore(client(t, e.proxy.URL, 0), kv)
}

// doc reads the checkpoint's _local doc.
func (e *fenceEnv) doc(t *testing.T, rule string) localDoc {
	t.Helper()
	d, found, err := e.store(t, nil).readDoc(t.Context(), rule, e.db)
	require.NoError(t, err)
	require.True(t, found, "the _local doc exists")
	return d
}

// deleteDoc deletes the checkpoint's _local doc only, as deleting and recreating its db does.
func deleteDoc(t *testing.T, s *OnChangeStore, rule, db string) {
	t.Helper()
	d, found, err := s.readDoc(t.Context(), rule, db)
	require.NoError(t, err)
	require.True(t, found)
	require.NoError(t, s.couch.Do(t.Context(), http.MethodDelete, localPath(s.couch, rule, db), url.Values{"rev": {d.Rev}}, nil, nil))
	// A db recreated has the doc on none of its shard copies; on a cluster the delete reaches
	// the last copy a moment after the answer.
	require.Eventually(t, func() bool {
		_, found, err := s.readDoc(t.Context(), rule, db)
		return err == nil && !found
	}, 10*time.Second, 20*time.Millisecond, "the deleted doc still reads")
}

// localProxy forwards to CouchDB. Like Apache CouchDB 3, which does not check the revs of
// _local docs ("disabled conflicts checks for local docs" in couch_db_updater), it lets every
// _local PUT win, on PouchDB Server too: it swaps the body's _rev for the current one. And it
// can hold the next _local PUT until the test releases it: a write that lands late.
type localProxy struct {
	URL     string
	backend string
	mu      sync.Mutex
	hold    chan struct{} // non-nil: the next _local PUT waits for it to close
	held    chan struct{} // closed once that PUT is waiting
}

func newLocalProxy(t *testing.T, backend string) *localProxy {
	t.Helper()
	p := &localProxy{backend: backend}
	u, err := url.Parse(backend)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPut && strings.Contains(r.URL.EscapedPath(), "/_local/") {
			p.mu.Lock()
			hold, held := p.hold, p.held
			p.hold, p.held = nil, nil
			p.mu.Unlock()
			if hold != nil {
				close(held)
				select {
				case <-hold:
				case <-r.Context().Done():
					return
				}
			}
			if err := p.lastWriterWins(r); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	pu, err := url.Parse(srv.URL)
	require.NoError(t, err)
	pu.User = u.User // the server's credentials: Apache CouchDB refuses anonymous requests
	p.URL = pu.String()
	return p
}

// holdNextPut makes the next _local PUT wait until release is called; held is closed once it
// waits.
func (p *localProxy) holdNextPut() (held <-chan struct{}, release func()) {
	hold, h := make(chan struct{}), make(chan struct{})
	p.mu.Lock()
	p.hold, p.held = hold, h
	p.mu.Unlock()
	return h, func() { close(hold) }
}

// lastWriterWins rewrites r's body with the doc's current _rev.
func (p *localProxy) lastWriterWins(r *http.Request) error {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return err
	}
	var doc map[string]any
	if err := json.Unmarshal(body, &doc); err != nil {
		return err
	}
	resp, err := http.Get(p.backend + r.URL.EscapedPath())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var cur struct {
		Rev string `json:"_rev"`
	}
	delete(doc, "_rev")
	if resp.StatusCode == http.StatusOK && json.NewDecoder(resp.Body).Decode(&cur) == nil && cur.Rev != "" {
		doc["_rev"] = cur.Rev
	}
	body, _ = json.Marshal(doc)
	r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	r.Header.Del("Content-Length")
	return nil
}

// deadKV is the cache as a process cut off from NATS sees it: every call fails.
type deadKV struct{ jetstream.KeyValue }

var errCutOff = errors.New("nats: timeout (cut off from NATS)")

func (deadKV) Get(context.Context, string) (jetstream.KeyValueEntry, error) { return nil, errCutOff }
func (deadKV) Create(context.Context, string, []byte, ...jetstream.KVCreateOpt) (uint64, error) {
	return 0, errCutOff
}
func (deadKV) Update(context.Context, string, []byte, uint64) (uint64, error) { return 0, errCutOff }
func (deadKV) Put(context.Context, string, []byte) (uint64, error)            { return 0, errCutOff }
func (deadKV) Delete(context.Context, string, ...jetstream.KVDeleteOpt) error { return errCutOff }
func (deadKV) Purge(context.Context, string, ...jetstream.KVDeleteOpt) error  { return errCutOff }

// TestStaleHolderIsFenced: an instance whose lease ran out but which is still running (the
// stale holder) read the checkpoint before a newer holder took over and wrote it. The stale
// holder's save is refused with ErrFenced and writes nothing — neither the entry, nor the
// _local doc — and the newer holder goes on saving. Whether the stale holder still reaches NATS
// or is cut off from it (it then cannot confirm its claim) makes no difference.
func TestStaleHolderIsFenced(t *testing.T) {
	for _, cutOff := range []bool{false, true} {
		name := "reaches NATS"
		if cutOff {
			name = "cut off from NATS"
		}
		t.Run(name, func(t *testing.T) {
			e := newFenceEnv(t)
			ctx := t.Context()
			newer := e.proxied(t, e.kv) // CouchDB semantics: a _local PUT is never refused
			p, err := newer.Load(ctx, "r", e.db)
			require.NoError(t, err)
			require.NoError(t, newer.Save(ctx, &p, "5-x"))

			staleKV := e.kv
			if cutOff {
				staleKV = deadKV{e.kv}
			}
			stale := e.proxied(t, e.kv)
			old, err := stale.Load(ctx, "r", e.db) // the stale holder's run read 5
			require.NoError(t, err)
			stale.kv = staleKV

			cur, err := newer.Load(ctx, "r", e.db) // the newer holder's run, after the lease ran out
			require.NoError(t, err)
			require.NoError(t, newer.Save(ctx, &cur, "10-x"))

			err = stale.Save(ctx, &old, "7-x")
			require.Error(t, err)
			if !cutOff {
				assert.ErrorIs(t, err, ErrFenced)
			} else {
				assert.NotErrorIs(t, err, ErrFenced, "an unanswered claim is transient, not fenced")
			}
			assert.Equal(t, "10-x", e.doc(t, "r").LastSeq, "the stale holder did not write the doc")
			require.NoError(t, newer.Save(ctx, &cur, "12-x"), "the newer holder still holds the checkpoint")
			again, err := newer.Load(ctx, "r", e.db)
			require.NoError(t, err)
			assert.Equal(t, "12-x", again.LastSeq)
			assert.Equal(t, "12-x", e.doc(t, "r").LastSeq)
		})
	}
}

// TestCacheReadErrorFailsTheLoad: a cache that does not answer fails the load (transient): it
// never falls back to the _local doc, which trails the entry, and the good entry stays.
func TestCacheReadErrorFailsTheLoad(t *testing.T) {
	e := newFenceEnv(t)
	ctx := t.Context()
	a := e.store(t, e.kv)
	a.LocalEvery = time.Hour
	p, err := a.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, a.Save(ctx, &p, "5-x"))
	require.NoError(t, a.Save(ctx, &p, "11-x"))
	require.Equal(t, "5-x", e.doc(t, "r").LastSeq, "the doc trails the entry")

	cut := e.store(t, deadKV{e.kv})
	q, err := cut.Load(ctx, "r", e.db)
	require.ErrorIs(t, err, errCutOff, "no fallback to the older _local doc (got %q)", q.LastSeq)

	// NATS answers again: the entry is intact, and a run goes on from it.
	b := e.store(t, e.kv)
	r, err := b.Load(ctx, "r", e.db)
	require.NoError(t, err)
	assert.Equal(t, "11-x", r.LastSeq)
	require.NoError(t, b.Verify(ctx, &r))
	require.NoError(t, b.Save(ctx, &r, "12-x"))
}

// TestReplayNotUndoneByARunningJob: a job claimed the checkpoint before `producer replay` and
// its _local write lands after the reset (CouchDB does not check _local revs). The job's save
// fails as fenced; the reset stands for the next run (read from the cache and verified), and
// that run's save puts the reset's lineage back into the doc.
func TestReplayNotUndoneByARunningJob(t *testing.T) {
	e := newFenceEnv(t)
	ctx := t.Context()
	job := e.proxied(t, e.kv)
	p, err := job.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, job.Save(ctx, &p, "5-x"))

	held, release := e.proxy.holdNextPut()
	saved := make(chan error, 1)
	go func() { saved <- job.Save(ctx, &p, "8-x") }() // claims, then its _local PUT waits
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the job's _local write never started")
	}
	require.NoError(t, e.store(t, e.kv).Reset(ctx, "r", e.db, "")) // producer replay
	release()
	var jobErr error
	select {
	case jobErr = <-saved:
	case <-time.After(10 * time.Second):
		t.Fatal("the job's save did not return")
	}
	require.ErrorIs(t, jobErr, ErrFenced)
	require.Equal(t, "8-x", e.doc(t, "r").LastSeq, "precondition: the late write landed over the reset's doc")

	next := e.store(t, e.kv)
	run, err := next.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, next.Verify(ctx, &run), "the doc is of the same lineage")
	assert.Equal(t, "", run.LastSeq, "the replay stands")
	require.NoError(t, next.Save(ctx, &run, "2-x"))
	d := e.doc(t, "r")
	assert.Equal(t, "2-x", d.LastSeq, "the doc is rewritten from the reset")
	assert.NotEmpty(t, d.ReplayedAt)
}

// TestVerifyDetectsARecreatedDB: a cached checkpoint of a db deleted and recreated since is
// ErrMoved whatever the new db's seqs (no _local doc, or one of another lineage), so that a run
// starts over; a doc of the same lineage that is not the entry's does not move it.
func TestVerifyDetectsARecreatedDB(t *testing.T) {
	e := newFenceEnv(t)
	ctx := t.Context()
	s := e.store(t, e.kv)
	p, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, s.Save(ctx, &p, "3"))

	require.NoError(t, e.srv.Do(t, http.MethodDelete, "/"+couchtest.PathDB(e.db), nil, nil))
	require.NoError(t, e.srv.Do(t, http.MethodPut, "/"+couchtest.PathDB(e.db), nil, nil))
	for i := range 5 { // the new db's seq passes the stale checkpoint's
		e.srv.Put(t, e.db, "d"+string(rune('a'+i)), map[string]any{})
	}
	cached, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.Equal(t, "3", cached.LastSeq)
	require.ErrorIs(t, s.Verify(ctx, &cached), ErrMoved)
	fresh, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	assert.False(t, fresh.Found, "the stale entry is dropped")

	// Another lineage in the doc: another checkpoint of the same name (the recreated db's).
	require.NoError(t, s.Save(ctx, &fresh, "5"))
	cached, err = s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	d := e.doc(t, "r")
	d.Instance = "someone-else"
	require.NoError(t, s.couch.Do(ctx, http.MethodPut, localPath(s.couch, "r", e.db), nil, d, nil))
	require.ErrorIs(t, s.Verify(ctx, &cached), ErrMoved)
}
