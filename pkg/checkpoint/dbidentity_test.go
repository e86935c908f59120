package checkpoint

import (
	"encoding/json"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// identity reads the db's identity doc ("" when there is none).
func (e *fenceEnv) identity(t *testing.T) string {
	t.Helper()
	id, err := e.store(t, nil).getIdentity(t.Context(), e.db)
	require.NoError(t, err)
	return id
}

// recreate deletes the db and creates it again, empty.
func (e *fenceEnv) recreate(t *testing.T) {
	t.Helper()
	require.NoError(t, e.srv.Do(t, http.MethodDelete, "/"+couchtest.PathDB(e.db), nil, nil))
	require.NoError(t, e.srv.Do(t, http.MethodPut, "/"+couchtest.PathDB(e.db), nil, nil))
}

// TestVerifyDetectsARecreatedDBWithAStaleDoc: a checkpoint write of the old db that lands in the
// db created again (CouchDB 3 takes a _local doc whatever its rev) brings the old db's lineage
// along, but not the old db's identity: the cached checkpoint is ErrMoved, the doc alone is no
// checkpoint of the new db, and the rule begins again there under the new db's identity.
func TestVerifyDetectsARecreatedDBWithAStaleDoc(t *testing.T) {
	e := newFenceEnv(t)
	ctx := t.Context()
	s := e.store(t, e.kv)
	p, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, s.Begin(ctx, &p))
	require.NoError(t, s.Save(ctx, &p, "3"))
	old := e.identity(t)
	require.NotEmpty(t, old, "the first checkpoint of the db created its identity")
	stale := e.doc(t, "r")
	require.Equal(t, old, stale.DBID)

	e.recreate(t)
	stale.Rev = ""
	require.NoError(t, s.couch.Do(ctx, http.MethodPut, localPath(s.couch, "r", e.db), nil, stale, nil))

	cached, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.True(t, cached.Cached())
	require.ErrorIs(t, s.Verify(ctx, &cached), ErrMoved, "same lineage in the doc, but the db has no identity")
	fresh, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	assert.False(t, fresh.Found, "the old db's doc is no checkpoint of the new db")

	// Without a cache the doc is read at once: the same answer.
	noCache, err := e.store(t, nil).Load(ctx, "r", e.db)
	require.NoError(t, err)
	assert.False(t, noCache.Found)

	require.NoError(t, s.Begin(ctx, &fresh))
	assert.Empty(t, fresh.LastSeq)
	now := e.identity(t)
	assert.NotEmpty(t, now)
	assert.NotEqual(t, old, now, "the new db has an identity of its own")
	assert.Equal(t, now, e.doc(t, "r").DBID)
	again, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, s.Verify(ctx, &again))
	assert.Empty(t, again.LastSeq)
}

// TestRulesBeginningAtOnceShareTheIdentity: the rules of a job begin in a new db at the same
// moment; through a server that lets every _local PUT win (as CouchDB 3 does), they still all
// record the one identity the db keeps, so none of them takes the db for recreated next time.
func TestRulesBeginningAtOnceShareTheIdentity(t *testing.T) {
	e := newFenceEnv(t)
	ctx := t.Context()
	s := e.proxied(t, e.kv)
	rules := []string{"a", "b", "c", "d", "e", "f"}
	var wg sync.WaitGroup
	errs := make([]error, len(rules))
	for i, r := range rules {
		wg.Go(func() {
			p, err := s.Load(ctx, r, e.db)
			if err == nil {
				err = s.Begin(ctx, &p)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	id := e.identity(t)
	require.NotEmpty(t, id)
	for i, r := range rules {
		require.NoError(t, errs[i])
		assert.Equal(t, id, e.doc(t, r).DBID, "rule %s", r)
		p, err := s.Load(ctx, r, e.db)
		require.NoError(t, err)
		assert.NoError(t, s.Verify(ctx, &p), "rule %s", r)
	}
}

// TestRuleBeginningAfterAnotherTakesItsIdentity: two rules of a job read a new db's identity
// missing, then begin one after the other. The second creates no identity of its own over the
// first's (a server that lets every _local PUT win, as CouchDB 3 does, would keep it): it takes
// the one this process has just created, so both checkpoints name the identity the db keeps.
func TestRuleBeginningAfterAnotherTakesItsIdentity(t *testing.T) {
	e := newFenceEnv(t)
	ctx := t.Context()
	s := e.proxied(t, e.kv)
	a, err := s.Load(ctx, "a", e.db)
	require.NoError(t, err)
	b, err := s.Load(ctx, "b", e.db)
	require.NoError(t, err)
	require.NoError(t, s.Begin(ctx, &a))
	require.NoError(t, s.Begin(ctx, &b))
	id := e.identity(t)
	require.NotEmpty(t, id)
	for _, r := range []string{"a", "b"} {
		assert.Equal(t, id, e.doc(t, r).DBID, "rule %s", r)
		p, err := s.Load(ctx, r, e.db)
		require.NoError(t, err)
		assert.NoError(t, s.Verify(ctx, &p), "rule %s", r)
	}
}

// TestLateWriteOfTheOldDBLeavesTheNewCheckpoint: a holder of the old db whose _local write lands
// after the db was created again and the rule began there writes the old db's checkpoint over
// the new one's (CouchDB 3). The entry, which is the new db's, stays in charge: no start over
// (nothing would be wrong, but a webhook rule would be sent the db's whole feed again), and the
// next save writes the new db's doc again.
func TestLateWriteOfTheOldDBLeavesTheNewCheckpoint(t *testing.T) {
	e := newFenceEnv(t)
	ctx := t.Context()
	late := e.proxied(t, e.kv)
	p, err := late.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, late.Begin(ctx, &p))
	require.NoError(t, late.Save(ctx, &p, "5"))

	held, release := e.proxy.holdNextPut()
	lateErr := make(chan error, 1)
	go func() { lateErr <- late.Save(ctx, &p, "9") }()
	<-held // claimed, its _local PUT on its way
	e.recreate(t)

	s := e.store(t, e.kv)
	cur, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.ErrorIs(t, s.Verify(ctx, &cur), ErrMoved)
	cur, err = s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.False(t, cur.Found)
	require.NoError(t, s.Begin(ctx, &cur))
	require.NoError(t, s.Save(ctx, &cur, "2"))

	release()
	require.ErrorIs(t, <-lateErr, ErrFenced)
	require.Equal(t, "9", e.doc(t, "r").LastSeq, "precondition: the late write landed in the new db")

	next, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, s.Verify(ctx, &next), "the new db's entry stands")
	assert.Equal(t, "2", next.LastSeq)
	require.NoError(t, s.Save(ctx, &next, "4"))
	d := e.doc(t, "r")
	assert.Equal(t, "4", d.LastSeq)
	assert.Equal(t, e.identity(t), d.DBID)
}

// TestEarlierReleaseCheckpointAdoptsTheIdentity: a checkpoint written by an earlier release names
// no identity, in its doc or its entry. It goes on as it is — a db without an identity doc is no
// reason to start over — and its next save records the db's identity (creating it).
func TestEarlierReleaseCheckpointAdoptsTheIdentity(t *testing.T) {
	for _, cached := range []bool{false, true} {
		name := "from the doc"
		if cached {
			name = "from the cache"
		}
		t.Run(name, func(t *testing.T) {
			e := newFenceEnv(t)
			ctx := t.Context()
			s := e.store(t, e.kv)
			d := localDoc{Rule: "r", LastSeq: "4", Instance: "earlier"}
			var ans struct {
				Rev string `json:"rev"`
			}
			require.NoError(t, s.couch.Do(ctx, http.MethodPut, localPath(s.couch, "r", e.db), nil, d, &ans))
			if cached {
				v, err := json.Marshal(cacheEntry{LastSeq: "6", Rev: ans.Rev, Instance: "earlier"})
				require.NoError(t, err)
				_, err = e.kv.Put(ctx, cacheKey("r", e.db), v)
				require.NoError(t, err)
			}

			p, err := s.Load(ctx, "r", e.db)
			require.NoError(t, err)
			require.True(t, p.Found)
			require.Equal(t, cached, p.Cached())
			require.NoError(t, s.Verify(ctx, &p), "no identity known: no reason to start over")
			require.Empty(t, e.identity(t))
			require.NoError(t, s.Save(ctx, &p, "8"))
			id := e.identity(t)
			require.NotEmpty(t, id, "the save created the db's identity")
			doc := e.doc(t, "r")
			assert.Equal(t, id, doc.DBID)
			assert.Equal(t, "8", doc.LastSeq)

			q, err := s.Load(ctx, "r", e.db)
			require.NoError(t, err)
			require.NoError(t, s.Verify(ctx, &q))
			assert.Equal(t, "8", q.LastSeq)
			assert.Equal(t, id, q.dbID, "the entry records it too")
		})
	}
}

// TestRebuiltShardCopyDoesNotStartOver: CouchDB's internal replication rebuilding a shard copy
// leaves the db as it was but makes its feed name new shard files in its seqs. Whether a db was
// created again is decided by its identity doc alone, never by the seqs: a checkpoint that moves
// from a seq of one set of files to a seq naming other files is verified and loaded as it is.
// The two seqs are recorded from CouchDB 3.3.3 (../shared/fixtures/couchdb-3.3): the last_seq
// of fx_src's _changes (changes-normal.http) and a seq of the _db_updates feed
// (db-updates-normal.http), another db's, whose files are others.
func TestRebuiltShardCopyDoesNotStartOver(t *testing.T) {
	const (
		before = "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ"
		after  = "11-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DTmCGmWZqam6eaY9OXBQA_YSid"
	)
	e := newFenceEnv(t)
	ctx := t.Context()
	s := e.store(t, e.kv)
	p, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, s.Begin(ctx, &p))
	require.NoError(t, s.Save(ctx, &p, before))
	id := e.identity(t)

	q, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.NoError(t, s.Verify(ctx, &q))
	require.NoError(t, s.Save(ctx, &q, after), "the feed now names the rebuilt copy's files")

	r, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	require.True(t, r.Cached())
	require.NoError(t, s.Verify(ctx, &r), "not taken for a db created again")
	assert.Equal(t, after, r.LastSeq)
	s.Forget(ctx, "r", e.db)
	fromDoc, err := s.Load(ctx, "r", e.db)
	require.NoError(t, err)
	assert.True(t, fromDoc.Found)
	assert.Equal(t, after, fromDoc.LastSeq)
	assert.Equal(t, id, e.identity(t), "the identity stays")
}
