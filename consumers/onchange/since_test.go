package main

import (
	"maps"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// TestSinceNow: a rule with since "now" ignores what a db held when the rule first saw it, and
// delivers everything written after; since "beginning" (the default) delivers the history too.
func TestSinceNow(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.Couch.Put(t, db, "old1", map[string]any{})
	e.Couch.Put(t, db, "old2", map[string]any{})

	now, all := newSink(t, nil), newSink(t, nil)
	e.ruleIn(t, app, "now_"+db, db, map[string]any{"url": now.URL + "/now", "since": "now", "block": true,
		"params": map[string]any{"id": "$change.id"}})
	waitRule(t, "all_"+db, e.putRule(t, "all_"+db, map[string]any{"db_name": only(db), "url": all.URL + "/all",
		"block": true, "params": map[string]any{"id": "$change.id"}}), app)

	// The first job: the since-now rule records the db's current seq and delivers nothing.
	e.enqueue(t, db)
	all.waitHits(t, 20*time.Second, hasID("old2"), "the since-beginning rule delivers the history")
	require.Eventually(t, func() bool { _, ok := e.checkpoint(t, "now_"+db, db); return ok }, 10*time.Second, 20*time.Millisecond,
		"the since-now rule saves its starting point at once")

	e.Couch.Put(t, db, "new1", map[string]any{})
	e.enqueue(t, db)
	now.waitHits(t, 20*time.Second, hasID("new1"), "a change after the rule saw the db is delivered")
	all.waitHits(t, 20*time.Second, hasID("new1"), "new1 to the other rule")
	assert.Equal(t, []string{"new1"}, ids(now.all()), "nothing written before the rule saw the db")
	// A sharded CouchDB db (q > 1) lists old1 and old2 in either order: its feed has no order
	// across shards. new1 came in a later job.
	got := ids(all.all())
	require.Len(t, got, 3)
	assert.ElementsMatch(t, []string{"old1", "old2"}, got[:2], "the history")
	assert.Equal(t, "new1", got[2])
}

// TestRecreatedDB: a db deleted and created again under the same name starts over from its
// beginning, although the rule's cached checkpoint points into the old db's history (no job
// ran while the db was missing, so nothing forgot it).
func TestRecreatedDB(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := couchtest.UniqueName(t, e.Prefix)
	e.Couch.CreateDB(t, db)
	t.Cleanup(func() { _ = e.Couch.Do(t, http.MethodDelete, "/"+couchtest.PathDB(db), nil, nil) })
	for _, id := range []string{"a1", "a2", "a3", "a4"} {
		e.Couch.Put(t, db, id, map[string]any{})
	}
	s := newSink(t, nil)
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/r", "block": true, "params": map[string]any{"id": "$change.id"}})
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) == 4 }, "first incarnation delivered")
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 10*time.Second, 20*time.Millisecond)

	// Delete and recreate with fewer changes than the old checkpoint's seq.
	require.NoError(t, e.Couch.Do(t, http.MethodDelete, "/"+couchtest.PathDB(db), nil, nil))
	require.Eventually(t, func() bool {
		if err := e.Couch.Do(t, http.MethodPut, "/"+couchtest.PathDB(db), nil, nil); err != nil {
			// PouchDB Server may bring a deleted db back, empty, by itself: that is a new db too.
			var info struct {
				Docs int `json:"doc_count"`
			}
			return e.Couch.PouchDB && e.Couch.Do(t, http.MethodGet, "/"+couchtest.PathDB(db), nil, &info) == nil && info.Docs == 0
		}
		return true
	}, 10*time.Second, 100*time.Millisecond)
	e.Couch.Put(t, db, "b1", map[string]any{})
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, hasID("b1"), "the recreated db's change is delivered")
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 10*time.Second, 20*time.Millisecond)
	got := ids(s.all())
	assert.ElementsMatch(t, []string{"a1", "a2", "a3", "a4"}, got[:4])
	for _, id := range got[4:] {
		assert.Equal(t, "b1", id, "after the first db's changes, only the new db's")
	}
	if e.Couch.PouchDB {
		// PouchDB Server finds nothing after the old db's integer seq: the cached checkpoint is
		// checked and found gone. (CouchDB itself starts a seq of other shards from 0.)
		assert.Contains(t, e.Logs.String(), "starting over")
	}
}

// TestMissingDBJobDropped: a job for a db that does not exist is acked with a warning, not
// retried, and leaves no dead letter.
func TestMissingDBJobDropped(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Prefix + "never_created"
	e.ruleIn(t, app, "miss", db, map[string]any{"url": "http://127.0.0.1:1/x"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return strings.Contains(e.Logs.String(), "db does not exist") }, 10*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return e.WorkMsgs(t) == 0 }, 10*time.Second, 20*time.Millisecond)
	assert.Empty(t, e.DeadLetters(t))
}

// instance returns db's instance_start_time.
func instance(t *testing.T, cs *couchtest.Server, db string) string {
	t.Helper()
	var info struct {
		Instance string `json:"instance_start_time"`
	}
	require.NoError(t, cs.Do(t, http.MethodGet, "/"+couchtest.PathDB(db), nil, &info))
	return info.Instance
}

// TestCheckpointRewrittenAtTheSameSeq: a job whose cached checkpoint finds nothing new checks it
// against the _local doc; when the doc is another checkpoint's since, at the same seq (a
// recreated db whose checkpoint another consumer wrote), the job starts over from the doc —
// which is where it stood — and must read that page again rather than wait for the one it had
// used up. Found by the chaos suite (SEED 7301): the job hung, ignoring its context, and every
// later change of the db waited behind it.
func TestCheckpointRewrittenAtTheSameSeq(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.Couch.Put(t, db, "a1", map[string]any{})
	s := newSink(t, nil)
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/r", "block": true, "params": map[string]any{"id": "$change.id"}})
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, hasID("a1"), "a1 delivered")
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 10*time.Second, 20*time.Millisecond)
	// The _local doc is written (by the rule's first run, at the beginning: LocalEvery batches
	// the later writes) and the cache holds the seq after a1.
	path := "/" + couchtest.PathDB(db) + "/_local/spiegel_onchange_r"
	var doc map[string]any
	require.Eventually(t, func() bool { return e.Couch.Do(t, http.MethodGet, path, nil, &doc) == nil }, 10*time.Second, 50*time.Millisecond)
	seq, _ := e.checkpoint(t, "r", db)
	require.NotEmpty(t, seq)

	// Another checkpoint of the same name is written at the cached seq (a new lineage: the db
	// was recreated and another consumer wrote it), the cache entry untouched.
	doc["instance"], doc["last_seq"] = "another-lineage", seq
	require.NoError(t, e.Couch.Do(t, http.MethodPut, path, doc, nil))
	e.enqueue(t, db) // finds nothing after the cached seq, checks the doc, starts over from it
	require.Eventually(t, func() bool { return strings.Contains(e.Logs.String(), "starting over") }, 20*time.Second, 50*time.Millisecond)

	e.Couch.Put(t, db, "a2", map[string]any{})
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, hasID("a2"), "the db's next change is delivered: the job that started over ended")
}

// TestCachedCheckpointIsVerified: a job whose checkpoint comes from the cache checks it against
// its _local doc before acting on anything: one read of the doc per job, on every server (the
// seqs are not read for it).
func TestCachedCheckpointIsVerified(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	target, err := url.Parse(e.Couch.URL)
	require.NoError(t, err)
	var localGets, localDocsPosts atomic.Int64
	var localDocsServed atomic.Bool // the server answered POST /{db}/_local_docs (CouchDB; not PouchDB Server)
	rp := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: target.Scheme, Host: target.Host, Path: target.Path})
	// Continuous feeds (the rules') pass line by line; asked for gzip, PouchDB Server would hold
	// them back in its compression.
	rp.FlushInterval, rp.Transport = -1, &http.Transport{DisableCompression: true}
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/_local/"):
			localGets.Add(1)
		case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/_local_docs"):
			localDocsPosts.Add(1)
			rec := httptest.NewRecorder()
			rp.ServeHTTP(rec, r)
			if rec.Code == http.StatusOK {
				localDocsServed.Store(true)
			}
			maps.Copy(w.Header(), rec.Header())
			w.WriteHeader(rec.Code)
			_, _ = w.Write(rec.Body.Bytes())
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(proxy.Close)
	u, _ := url.Parse(proxy.URL)
	u.User = target.User
	e.cfg.CouchDB.CouchDBURL = u.String()
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.Couch.Put(t, db, "a1", map[string]any{})
	s := newSink(t, nil)
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/r", "params": map[string]any{"id": "$change.id"}})
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, hasID("a1"), "a1 delivered")
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 10*time.Second, 20*time.Millisecond)
	seq, found := e.checkpoint(t, "r", db)
	require.True(t, found, "the checkpoint is cached")

	gets, posts := localGets.Load(), localDocsPosts.Load()
	e.Couch.Put(t, db, "a2", map[string]any{})
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, hasID("a2"), "a2 delivered")
	gets, posts = localGets.Load()-gets, localDocsPosts.Load()-posts
	if localDocsServed.Load() {
		assert.Equal(t, [2]int64{0, 1}, [2]int64{gets, posts}, "_local GETs and POST _local_docs of the second job (checkpoint %q): both docs in one request, read while the first page is", seq)
	} else {
		assert.Equal(t, [2]int64{2, 0}, [2]int64{gets, posts}, "_local GETs and POST _local_docs of the second job (checkpoint %q): the doc and the db's identity doc, no second try of an endpoint the server lacks", seq)
	}
}
