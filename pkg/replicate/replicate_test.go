package replicate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// killSwitch is a transport that, once tripped, fails every request as a dead process would
// (no flush of the checkpoint gets through), and trips itself after a number of successful
// _bulk_docs answers.
type killSwitch struct {
	base      http.RoundTripper
	after     int64
	bulkDocs  atomic.Int64
	dead      atomic.Bool
	onTripped func()
}

func (k *killSwitch) RoundTrip(req *http.Request) (*http.Response, error) {
	if k.dead.Load() {
		return nil, errors.New("killed")
	}
	resp, err := k.base.RoundTrip(req)
	if err == nil && strings.HasSuffix(req.URL.Path, "/_bulk_docs") && resp.StatusCode < 300 {
		if k.bulkDocs.Add(1) == k.after {
			k.dead.Store(true)
			k.onTripped()
		}
	}
	return resp, err
}

// TestKillAndResume kills a replication of many docs midway (its transport dies after some
// batches, after interval checkpoints were written) and runs it again: the second run resumes
// from the checkpoint, reads fewer docs than the total, and the target converges.
func TestKillAndResume(t *testing.T) {
	s := couchtest.Get(t)
	const total = 20000
	source, target := s.NewDB(t, "ksrc_"), s.NewDB(t, "ktgt_")
	createDocs(t, s, source, "d", total)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ks := &killSwitch{base: &http.Transport{DisableCompression: true}, after: 16, onTripped: cancel}
	opt := Options{
		Source: dbURL(s, source), Target: dbURL(s, target),
		BatchSize: 500, Workers: 4, CheckpointInterval: 200 * time.Millisecond,
		HTTPClient: &http.Client{Transport: ks},
	}
	start := time.Now()
	first, err := Run(ctx, opt, testLog(t))
	require.Error(t, err, "the killed run fails")
	assert.False(t, first.OK)
	t.Logf("killed run: %s, docs written %d, checkpoint %q", time.Since(start), first.DocsWritten, first.EndSeq)
	require.NotEmpty(t, first.EndSeq, "a checkpoint was written before the kill")

	opt.HTTPClient = nil
	second, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	t.Logf("resumed run: start %q, docs read %d, written %d", second.StartSeq, second.DocsRead, second.DocsWritten)
	// Usually first.EndSeq; a kill between the two checkpoint PUTs may leave the source one
	// checkpoint ahead of what the killed run reported, which is as safe.
	assert.NotEmpty(t, second.StartSeq, "resumes from the killed run's checkpoint")
	assert.Less(t, second.DocsRead, int64(total))
	assert.Positive(t, second.DocsRead)
	assert.Equal(t, total, docCount(t, s, target))

	third, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, third.NoChanges)
}

// TestNoChangesWritesNothing: a second run with nothing new writes nothing, in at most 4
// requests (checkpoint reads on both sides, one _changes).
func TestNoChangesWritesNothing(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "nsrc_"), s.NewDB(t, "ntgt_")
	createDocs(t, s, source, "n", 25)
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target)}
	first, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	require.EqualValues(t, 25, first.DocsWritten)
	assert.False(t, first.NoChanges)

	second, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, second.OK)
	assert.True(t, second.NoChanges)
	assert.Zero(t, second.DocsWritten)
	assert.Zero(t, second.DocsRead)
	assert.Equal(t, first.EndSeq, second.StartSeq)
	assert.LessOrEqual(t, second.Requests, int64(4))
	t.Logf("no-change run: %d requests", second.Requests)
}

// TestIncrementalRequests: a db that received 1–3 docs since its last replication costs at most
// 8 requests per run.
func TestIncrementalRequests(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "isrc_"), s.NewDB(t, "itgt_")
	createDocs(t, s, source, "base", 50)
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target)}
	_, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	for n := 1; n <= 3; n++ {
		for i := range n {
			s.Put(t, source, fmt.Sprintf("new-%d-%d", n, i), map[string]any{"i": i})
		}
		res, err := Run(t.Context(), opt, testLog(t))
		require.NoError(t, err)
		assert.EqualValues(t, n, res.DocsWritten)
		assert.LessOrEqual(t, res.Requests, int64(8), "%d new docs", n)
		t.Logf("%d new docs: %d requests", n, res.Requests)
	}
	requireSameLeaves(t, s, source, target)
}

// TestFirstRunReadsNoDBInfo: a replication's first run reads both checkpoint docs and, when the
// 404s say the docs are missing from dbs that exist, checks neither db's existence (no HEAD):
// at 10,000 dbs an initial sync would spend two requests per db on it. A missing db is still
// told by its own answer (TestMissingDBs).
func TestFirstRunReadsNoDBInfo(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "fsrc_"), s.NewDB(t, "ftgt_")
	createDocs(t, s, source, "f", 5)
	log := &requestLog{base: &http.Transport{DisableCompression: true}}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), HTTPClient: &http.Client{Transport: log}}
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 5, res.DocsWritten)
	reqs := log.take()
	assert.Zero(t, count(reqs, func(r string) bool { return strings.HasPrefix(r, "HEAD ") }), "%v", reqs)
	assert.Equal(t, 2, count(reqs, func(r string) bool { return strings.HasPrefix(r, "GET ") && strings.Contains(r, "/_local/") }), "%v", reqs)
	requireSameLeaves(t, s, source, target)
}

// TestCheckpointCache: with the checkpoint cache and deferred checkpoints, an incremental run of
// a new doc costs two requests (_changes with the doc, _bulk_docs: the run continues this
// process's progress, so a small batch of new docs is written without _revs_diff, see
// run.process) plus one verification of the cached checkpoint (the target's _local doc, read
// after the write: source and target are on one server, so the run holds one connection at a
// time), and a run without changes _changes and the verification; a cache that another process
// made stale costs no doc twice on the target; a target deleted and recreated behind the hot
// cache's back is replicated from the beginning by the next run.
func TestCheckpointCache(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "csrc_"), s.NewDB(t, "ctgt_")
	createDocs(t, s, source, "base", 20)
	cache := NewCheckpointCache(time.Hour, 100)
	log := &requestLog{base: &http.Transport{DisableCompression: true}}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), CheckpointDefer: time.Hour, Checkpoints: cache,
		HTTPClient: &http.Client{Transport: log}}
	_, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	verification := func(r string) bool {
		return strings.HasPrefix(r, "GET /"+couchtest.PathDB(target)+"/_local/")
	}
	log.take()
	log.takePeak()
	for i := 1; i <= 3; i++ {
		s.Put(t, source, fmt.Sprintf("new-%d", i), map[string]any{"i": i})
		res, err := Run(t.Context(), opt, testLog(t))
		require.NoError(t, err)
		assert.EqualValues(t, 1, res.DocsWritten)
		assert.Equal(t, 1, log.takePeak(), "run %d: one request at a time", i)
		reqs := log.take()
		verifications := count(reqs, verification)
		assert.Equal(t, 1, verifications, "run %d verifies the cached checkpoint once: %v", i, reqs)
		assert.Equal(t, 2, len(reqs)-verifications, "run %d: %v", i, reqs)
		assert.True(t, verification(reqs[len(reqs)-1]), "run %d verifies after its write: %v", i, reqs)
		assert.EqualValues(t, len(reqs), res.Requests)
		t.Logf("incremental run %d: %d requests + %d verification", i, len(reqs)-verifications, verifications)
	}
	none, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, none.NoChanges)
	reqs := log.take()
	assert.Equal(t, 1, count(reqs, verification), "%v", reqs)
	assert.EqualValues(t, 2, none.Requests, "a run without changes reads _changes and verifies: %v", reqs)
	requireSameLeaves(t, s, source, target)

	// Another process (no shared cache) runs the replication meanwhile: this one's cache is
	// stale. Its next run sends the other's doc with its own (a small batch of new docs past
	// its progress), which the target keeps as it was; then the verification finds the
	// target's checkpoint moved, and the run starts again from it: nothing is written twice.
	s.Put(t, source, "elsewhere", map[string]any{})
	other := opt
	other.Checkpoints, other.CheckpointDefer, other.HTTPClient = nil, 0, nil
	_, err = Run(t.Context(), other, testLog(t))
	require.NoError(t, err)
	elsewhere := func() (doc map[string]any) { // with its revision history
		require.NoError(t, s.Do(t, "GET", "/"+couchtest.PathDB(target)+"/elsewhere?revs=true&conflicts=true", nil, &doc))
		return doc
	}
	held := elsewhere()
	s.Put(t, source, "here", map[string]any{})
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 2, res.DocsWritten, "the other's doc and the new one, sent once each")
	assert.Equal(t, held, elsewhere(), "the target keeps the doc it held")
	requireSameLeaves(t, s, source, target)
	log.take()
	again, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, again.NoChanges, "the run that started again left a cache entry of its own")
	assert.Equal(t, 1, count(log.take(), verification))

	// The target is deleted and recreated empty; the cache is hot, yet the next run finds the
	// target's checkpoint gone and replicates everything, as CouchDB's replicator does.
	res, err = Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	require.True(t, res.NoChanges, "precondition: the cache entry is fresh and current")
	require.NoError(t, s.Do(t, "DELETE", "/"+couchtest.PathDB(target), nil, nil))
	require.NoError(t, s.Do(t, "PUT", "/"+couchtest.PathDB(target), nil, nil))
	s.Put(t, source, "after-recreate", map[string]any{})
	res, err = Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.Empty(t, res.StartSeq, "started over from the beginning")
	assert.False(t, res.CheckpointDeferred, "the run that started over wrote its checkpoint (its first attempt had deferred it)")
	assert.NotEqual(t, res.StartSeq, res.EndSeq)
	requireSameLeaves(t, s, source, target)
}

// TestCheckpointCacheVerifiedBeforeCheckpoint: a cached run verifies the target before its
// first checkpoint write, not only at its end. The target is deleted and recreated behind the
// hot cache's back, and the run reads several pages (so it checkpoints): without the
// verification first, its checkpoint would land in the new target (Apache CouchDB does not
// check the revs of _local docs) and the next attempt would start from it, leaving the docs
// before it out.
func TestCheckpointCacheVerifiedBeforeCheckpoint(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "vsrc_"), s.NewDB(t, "vtgt_")
	createDocs(t, s, source, "base", 5)
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), BatchSize: 4, Workers: 1,
		CheckpointDefer: time.Hour, Checkpoints: NewCheckpointCache(time.Hour, 10)}
	_, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)

	require.NoError(t, s.Do(t, "DELETE", "/"+couchtest.PathDB(target), nil, nil))
	require.NoError(t, s.Do(t, "PUT", "/"+couchtest.PathDB(target), nil, nil))
	createDocs(t, s, source, "later", 12) // three pages of new docs, each written blind
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.Empty(t, res.StartSeq, "started over from the beginning")
	assert.False(t, res.CheckpointDeferred)
	requireSameLeaves(t, s, source, target)
}

// deleteOnce is a transport that deletes a db once, just before the first request that
// matches goes out (a db deleted while a run is under way), and then calls then, if set, before
// it hands that request's answer on (a db created again meanwhile).
type deleteOnce struct {
	base  http.RoundTripper
	match func(*http.Request) bool
	del   func()
	then  func()
	once  atomic.Bool
}

func (d *deleteOnce) RoundTrip(req *http.Request) (*http.Response, error) {
	if !d.match(req) || !d.once.CompareAndSwap(false, true) {
		return d.base.RoundTrip(req)
	}
	d.del()
	resp, err := d.base.RoundTrip(req)
	if d.then != nil {
		d.then()
	}
	return resp, err
}

// A target deleted while a run is under way, or since the checkpoint the run took from its
// cache, answers the run's writes with "Database does not exist". The run starts again from
// reading both checkpoints, as for a recreated target: with create_target it creates the
// target and replicates everything; without it the target is reported missing
// (ErrTargetNotFound, retried by the consumer), not a permanent failure of the rule.
func TestTargetDeletedDuringTheRun(t *testing.T) {
	s := couchtest.Get(t)
	for _, tc := range []struct {
		name          string
		cached, creat bool
	}{
		{"cached/create_target", true, true},
		{"uncached/create_target", false, true},
		{"cached/no create_target", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			source, target := s.NewDB(t, "gsrc_"), s.NewDB(t, "gtgt_")
			createDocs(t, s, source, "base", 5)
			var cache *CheckpointCache
			if tc.cached {
				cache = NewCheckpointCache(time.Hour, 10)
			}
			deleteTarget := func() { require.NoError(t, s.Do(t, "DELETE", "/"+couchtest.PathDB(target), nil, nil)) }
			tr := &deleteOnce{base: &http.Transport{DisableCompression: true}, del: deleteTarget, match: func(*http.Request) bool { return false }}
			opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), CreateTarget: tc.creat, CheckpointDefer: time.Hour,
				Checkpoints: cache, HTTPClient: &http.Client{Transport: tr}}
			_, err := Run(t.Context(), opt, testLog(t))
			require.NoError(t, err)

			createDocs(t, s, source, "later", 3)
			if tc.cached {
				deleteTarget() // behind the hot cache's back
			} else { // after the run read both checkpoints, as it reads the changes
				tr.match = func(r *http.Request) bool { return strings.HasSuffix(r.URL.Path, "/_changes") }
			}
			res, err := Run(t.Context(), opt, testLog(t))
			if !tc.creat {
				require.ErrorIs(t, err, ErrTargetNotFound)
				return
			}
			require.NoError(t, err)
			assert.Empty(t, res.StartSeq, "started over from the beginning")
			requireSameLeaves(t, s, source, target)
		})
	}
}

// failHead fails the HEAD requests of a db (whether it exists) while on is set, as a connection
// cut does.
type failHead struct {
	base http.RoundTripper
	on   atomic.Bool
}

func (f *failHead) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodHead && f.on.Load() {
		return nil, errors.New("connection reset by peer")
	}
	return f.base.RoundTrip(req)
}

// A db that answers "Database does not exist" in the middle of a run while CouchDB cannot be
// asked which db is gone (a connection cut, as in a chaos run): the 404 is no verdict on the
// rule. The run fails with a transient error (the consumer retries it, never dead-letters it),
// and the next run creates the target and replicates everything.
func TestDBGoneWhileCouchDBCannotBeAsked(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "asrc_"), s.NewDB(t, "atgt_")
	createDocs(t, s, source, "base", 5)
	heads := &failHead{base: &http.Transport{DisableCompression: true}}
	tr := &deleteOnce{base: heads, match: func(r *http.Request) bool { return strings.HasSuffix(r.URL.Path, "/_changes") },
		del: func() {
			require.NoError(t, s.Do(t, "DELETE", "/"+couchtest.PathDB(target), nil, nil))
			heads.on.Store(true)
		}}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), CreateTarget: true, HTTPClient: &http.Client{Transport: tr}}
	_, err := Run(t.Context(), opt, testLog(t))
	require.Error(t, err)
	var he *couch.HTTPError
	assert.False(t, errors.As(err, &he) && couch.Classify(he) != couch.Transient, "a transient failure: %v", err)
	assert.NotErrorIs(t, err, ErrSourceNotFound)
	assert.NotErrorIs(t, err, ErrTargetNotFound)

	heads.on.Store(false)
	_, err = Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	requireSameLeaves(t, s, source, target)
}

// A source deleted as the run reads its changes, and created again before the run asks whether
// it exists: the 404 of its _changes is not a failure of the rule. The run starts again from
// both checkpoints and replicates the new source's docs.
func TestSourceRecreatedDuringTheRun(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "rsrc_"), s.NewDB(t, "rtgt_")
	createDocs(t, s, source, "base", 5)
	tr := &deleteOnce{base: &http.Transport{DisableCompression: true}, match: func(*http.Request) bool { return false },
		del: func() { require.NoError(t, s.Do(t, "DELETE", "/"+couchtest.PathDB(source), nil, nil)) },
		then: func() {
			require.NoError(t, s.Do(t, "PUT", "/"+couchtest.PathDB(source), nil, nil))
			createDocs(t, s, source, "again", 3)
		}}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), HTTPClient: &http.Client{Transport: tr}}
	_, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)

	tr.match = func(r *http.Request) bool { return strings.HasSuffix(r.URL.Path, "/_changes") }
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 3, res.DocsWritten, "the new source's docs")
	var doc map[string]any
	require.NoError(t, s.Do(t, "GET", "/"+couchtest.PathDB(target)+"/again000000", nil, &doc))
}

// TestCheckpointDefer: a burst of small runs on one db writes one checkpoint, not one per run;
// each deferred run costs two requests less, later runs re-read the skipped changes without
// writing them twice, and a run past the window checkpoints again.
func TestCheckpointDefer(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "dsrc_"), s.NewDB(t, "dtgt_")
	createDocs(t, s, source, "base", 10)
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), CheckpointDefer: time.Hour}
	first, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	require.False(t, first.CheckpointDeferred, "the first run has no checkpoint to lean on")
	checkpoint := first.EndSeq

	for i := 1; i <= 3; i++ {
		s.Put(t, source, fmt.Sprintf("burst-%d", i), map[string]any{"i": i})
		res, err := Run(t.Context(), opt, testLog(t))
		require.NoError(t, err)
		assert.True(t, res.CheckpointDeferred, "run %d", i)
		assert.Equal(t, checkpoint, res.StartSeq, "run %d starts at the one checkpoint", i)
		assert.Equal(t, checkpoint, res.EndSeq)
		assert.EqualValues(t, 1, res.DocsWritten, "run %d writes only its new doc", i)
		assert.EqualValues(t, i, res.MissingChecked, "run %d re-checks the skipped changes", i)
		assert.LessOrEqual(t, res.Requests, int64(6), "no checkpoint PUTs")
	}
	requireSameLeaves(t, s, source, target)

	opt.CheckpointDefer = 0
	s.Put(t, source, "after", map[string]any{})
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.False(t, res.CheckpointDeferred)
	assert.NotEqual(t, checkpoint, res.EndSeq)
	again, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, again.NoChanges, "the checkpoint covers the whole burst")
	requireSameLeaves(t, s, source, target)
}

// TestCheckpointDeferChanges: past the time window, a small run still defers its checkpoint
// while fewer than CheckpointDeferChanges changes were read past the checkpoint, counted across
// runs whether their progress was cached or the changes were read again; the run that reaches
// the count checkpoints, and the count starts again.
func TestCheckpointDeferChanges(t *testing.T) {
	for _, cached := range []bool{false, true} {
		t.Run(fmt.Sprintf("cached=%v", cached), func(t *testing.T) {
			s := couchtest.Get(t)
			source, target := s.NewDB(t, "csrc_"), s.NewDB(t, "ctgt_")
			createDocs(t, s, source, "base", 10)
			opt := Options{Source: dbURL(s, source), Target: dbURL(s, target),
				CheckpointDefer: time.Nanosecond, CheckpointDeferChanges: 3} // every checkpoint is old
			if cached {
				opt.Checkpoints = NewCheckpointCache(time.Hour, 10)
			}
			first, err := Run(t.Context(), opt, testLog(t))
			require.NoError(t, err)
			require.False(t, first.CheckpointDeferred, "the first run has no checkpoint to lean on")
			session := targetSession(t, s, target, first.ReplicationID)

			for i := 1; i <= 4; i++ {
				s.Put(t, source, fmt.Sprintf("later-%d", i), map[string]any{"i": i})
				res, err := Run(t.Context(), opt, testLog(t))
				require.NoError(t, err)
				assert.EqualValues(t, 1, res.DocsWritten, "run %d writes only its new doc", i)
				switch i {
				case 1, 2:
					assert.True(t, res.CheckpointDeferred, "run %d: %d changes past the checkpoint", i, i)
					assert.Equal(t, session, targetSession(t, s, target, res.ReplicationID))
				case 3:
					assert.False(t, res.CheckpointDeferred, "run 3 reaches 3 changes")
					assert.Equal(t, res.SessionID, targetSession(t, s, target, res.ReplicationID))
					session = res.SessionID
				case 4:
					assert.True(t, res.CheckpointDeferred, "the count started again")
					assert.Equal(t, session, targetSession(t, s, target, res.ReplicationID))
				}
			}
			requireSameLeaves(t, s, source, target)

			opt.CheckpointDeferChanges = 0 // the time window alone: an old checkpoint is written
			s.Put(t, source, "after", map[string]any{})
			res, err := Run(t.Context(), opt, testLog(t))
			require.NoError(t, err)
			assert.False(t, res.CheckpointDeferred)
		})
	}
}

// TestMissingDBs: a missing source is ErrSourceNotFound naming it; a missing target is
// ErrTargetNotFound without CreateTarget and is created with it. Neither is created by a
// failed run.
func TestMissingDBs(t *testing.T) {
	s := couchtest.Get(t)
	existing := s.NewDB(t, "msrc_")
	createDocs(t, s, existing, "m", 3)

	t.Run("source", func(t *testing.T) {
		missing := couchtest.UniqueName(t, "nosrc_")
		_, err := Run(t.Context(), Options{Source: dbURL(s, missing), Target: dbURL(s, existing)}, testLog(t))
		require.ErrorIs(t, err, ErrSourceNotFound)
		assert.Contains(t, err.Error(), missing)
		assert.Equal(t, http.StatusNotFound, status(t, s, missing), "the source is not created")
	})
	t.Run("target", func(t *testing.T) {
		missing := couchtest.UniqueName(t, "notgt_")
		s.Cleanup(t, missing)
		_, err := Run(t.Context(), Options{Source: dbURL(s, existing), Target: dbURL(s, missing)}, testLog(t))
		require.ErrorIs(t, err, ErrTargetNotFound)
		assert.Contains(t, err.Error(), missing)
		assert.Equal(t, http.StatusNotFound, status(t, s, missing))

		res, err := Run(t.Context(), Options{Source: dbURL(s, existing), Target: dbURL(s, missing), CreateTarget: true}, testLog(t))
		require.NoError(t, err)
		assert.EqualValues(t, 3, res.DocsWritten)
		assert.Equal(t, 3, docCount(t, s, missing))
	})
}

// TestMissingSourceRedacted: the error of a missing source names it without its password (a
// fake server that knows no db, since the test server may refuse made-up credentials).
func TestMissingSourceRedacted(t *testing.T) {
	t.Parallel()
	var gotAuth atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); ok && u == "admin" && p == "s3cret-pw" {
			gotAuth.Store(true)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"error":"not_found","reason":"Database does not exist."}`))
	}))
	defer srv.Close()
	src := strings.Replace(srv.URL, "http://", "http://admin:s3cret-pw@", 1) + "/gone"
	res, err := Run(t.Context(), Options{Source: src, Target: srv.URL + "/tgt"}, testLog(t))
	require.ErrorIs(t, err, ErrSourceNotFound)
	assert.Contains(t, err.Error(), "admin:xxxxx@")
	assert.Contains(t, err.Error(), "/gone")
	assert.NotContains(t, err.Error(), "s3cret-pw")
	assert.True(t, gotAuth.Load(), "credentials are sent as Basic auth")
	assert.Positive(t, res.Requests)
}

func status(t *testing.T, s *couchtest.Server, db string) int {
	st, _ := raw(t, s, http.MethodGet, "/"+url.PathEscape(db), nil, "application/json")
	return st
}

// TestFilteredReplication: doc_ids and selector (local on PouchDB Server, server-side on
// CouchDB) replicate only the matching docs, and their checkpoints are separate.
func TestFilteredReplication(t *testing.T) {
	s := couchtest.Get(t)
	source := s.NewDB(t, "fsrc_")
	for i := range 10 {
		s.Put(t, source, fmt.Sprintf("f%d", i), map[string]any{"kind": []string{"even", "odd"}[i%2], "i": i})
	}
	t.Run("doc_ids", func(t *testing.T) {
		target := s.NewDB(t, "ftgt_")
		res, err := Run(t.Context(), Options{Source: dbURL(s, source), Target: dbURL(s, target), DocIDs: []string{"f1", "f2", "nosuch"}}, testLog(t))
		require.NoError(t, err)
		assert.EqualValues(t, 2, res.DocsWritten)
		assert.Equal(t, 2, docCount(t, s, target))
	})
	t.Run("selector", func(t *testing.T) {
		target := s.NewDB(t, "ftgt_")
		opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), Selector: map[string]any{"kind": "odd"}}
		res, err := Run(t.Context(), opt, testLog(t))
		require.NoError(t, err)
		assert.EqualValues(t, 5, res.DocsWritten)
		assert.Equal(t, 5, docCount(t, s, target))
		s.Put(t, source, "f10", map[string]any{"kind": "odd"})
		s.Put(t, source, "f11", map[string]any{"kind": "even"})
		res, err = Run(t.Context(), opt, testLog(t))
		require.NoError(t, err)
		assert.EqualValues(t, 1, res.DocsWritten)
	})
	t.Run("design-doc filter, then edited", func(t *testing.T) {
		kinds := map[string]int{}
		for i := range 10 {
			kinds[[]string{"even", "odd"}[i%2]]++
		}
		target := s.NewDB(t, "ftgt_")
		src := s.NewDB(t, "fsrc_")
		for i := range 10 {
			s.Put(t, src, fmt.Sprintf("f%d", i), map[string]any{"kind": []string{"even", "odd"}[i%2]})
		}
		filter := func(kind string) string { return "function(doc) { return doc.kind === '" + kind + "'; }" }
		rev := s.Put(t, src, "_design/f", map[string]any{"filters": map[string]any{"kind": filter("odd")}})
		opt := Options{Source: dbURL(s, src), Target: dbURL(s, target), Filter: "f/kind"}
		first, err := Run(t.Context(), opt, testLog(t))
		require.NoError(t, err)
		assert.EqualValues(t, kinds["odd"], first.DocsWritten)

		// The same filter name with other code is another replication: it starts from the
		// beginning instead of from the checkpoint of the old code, and finds the even docs.
		s.Put(t, src, "_design/f", map[string]any{"_rev": rev, "filters": map[string]any{"kind": filter("even")}})
		second, err := Run(t.Context(), opt, testLog(t))
		require.NoError(t, err)
		assert.NotEqual(t, first.ReplicationID, second.ReplicationID)
		assert.Empty(t, second.StartSeq, "from the beginning")
		assert.EqualValues(t, kinds["even"], second.DocsWritten)
		assert.Equal(t, 10, docCount(t, s, target))

		_, err = Run(t.Context(), Options{Source: dbURL(s, src), Target: dbURL(s, target), Filter: "f/nosuch"}, testLog(t))
		require.Error(t, err)
		assert.Contains(t, err.Error(), `no filter "nosuch"`)
	})
}

// TestWriteFailuresCounted: docs the target refuses (validate_doc_update) are counted, not
// fatal; the others are written and the run checkpoints past them.
func TestWriteFailuresCounted(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "wsrc_"), s.NewDB(t, "wtgt_")
	s.Put(t, target, "_design/v", map[string]any{
		"validate_doc_update": `function(doc) { if (doc.bad) { throw({forbidden: "bad doc"}); } }`,
	})
	for i := range 6 {
		s.Put(t, source, fmt.Sprintf("w%d", i), map[string]any{"bad": i%3 == 0})
	}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target)}
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, res.OK)
	assert.EqualValues(t, 6, res.DocsRead)
	assert.EqualValues(t, 4, res.DocsWritten)
	assert.EqualValues(t, 2, res.DocWriteFailures)
	assert.Equal(t, 5, docCount(t, s, target), "4 docs and the design doc")

	again, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, again.NoChanges, "refused docs are not retried forever")
}

// TestCancelRecordsProgress: a cancelled run (ctx) still checkpoints the batches it completed,
// and the next run starts from there.
func TestCancelRecordsProgress(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "csrc_"), s.NewDB(t, "ctgt_")
	createDocs(t, s, source, "c", 3000)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// Cancel after the second batch is written, without killing the transport: the flush of the
	// checkpoint must get through.
	base := &http.Transport{DisableCompression: true}
	var written atomic.Int64
	hc := &http.Client{Transport: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := base.RoundTrip(r)
		if err == nil && strings.HasSuffix(r.URL.Path, "/_bulk_docs") && written.Add(1) == 2 {
			cancel()
		}
		return resp, err
	})}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), BatchSize: 200, Workers: 1, HTTPClient: hc}
	first, err := Run(ctx, opt, testLog(t))
	require.ErrorIs(t, err, context.Canceled)
	require.NotEmpty(t, first.EndSeq, "completed batches were checkpointed on cancellation")
	opt.HTTPClient = nil
	second, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.Equal(t, first.EndSeq, second.StartSeq)
	assert.Less(t, second.DocsRead, int64(3000))
	assert.Equal(t, 3000, docCount(t, s, target))
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
