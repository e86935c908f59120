package checkpoint

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// newOnChangeStores returns two stores (two consumer processes) sharing one cache, and a db.
func newOnChangeStores(t *testing.T) (a, b *OnChangeStore, db string) {
	t.Helper()
	srv := couchtest.Get(t)
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	topo := natsjs.DefaultTopology("")
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	kv, err := natsjs.OnChangeBucket(t.Context(), js, topo)
	require.NoError(t, err)
	db = srv.NewDB(t, "a/b+c_")
	if srv.PouchDB {
		db = srv.NewDB(t, "ab+c_") // PouchDB Server cannot address a '/' in a db name
	}
	return NewOnChangeStore(client(t, srv.URL, 0), kv), NewOnChangeStore(client(t, srv.URL, 0), kv), db
}

// TestOnChangeStoreRoundTrip: a new checkpoint is not found; saved, it is read back from the
// cache by another process, and its _local doc holds it too.
func TestOnChangeStoreRoundTrip(t *testing.T) {
	a, b, db := newOnChangeStores(t)
	ctx := t.Context()
	p, err := a.Load(ctx, "rule/1", db)
	require.NoError(t, err)
	assert.False(t, p.Found)
	require.NoError(t, a.Save(ctx, &p, "7-x"))
	require.NoError(t, a.Save(ctx, &p, "9-x"))

	q, err := b.Load(ctx, "rule/1", db)
	require.NoError(t, err)
	assert.True(t, q.Found)
	assert.Equal(t, "9-x", q.LastSeq)
	assert.True(t, q.cached, "read from the cache")
	require.NoError(t, b.Verify(ctx, &q), "the cached checkpoint is the doc's")

	a.Forget(ctx, "rule/1", db)
	r, err := b.Load(ctx, "rule/1", db)
	require.NoError(t, err)
	assert.Equal(t, "9-x", r.LastSeq, "the _local doc holds it")
	assert.False(t, r.cached)

	// The other process goes on from there (one job per db at a time), then the first one.
	require.NoError(t, b.Save(ctx, &r, "12-x"))
	p, err = a.Load(ctx, "rule/1", db)
	require.NoError(t, err)
	require.NoError(t, a.Save(ctx, &p, "15-x"))
	p, err = b.Load(ctx, "rule/1", db)
	require.NoError(t, err)
	assert.Equal(t, "15-x", p.LastSeq)
}

// TestOnChangeStoreReplayWins: a replay during a run makes the run's save ErrFenced: its
// progress does not overwrite the reset, and the next load reads the reset.
func TestOnChangeStoreReplayWins(t *testing.T) {
	a, b, db := newOnChangeStores(t)
	ctx := t.Context()
	p, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	require.NoError(t, a.Save(ctx, &p, "5-x"))

	run, err := a.Load(ctx, "r", db) // a run starts from 5
	require.NoError(t, err)
	require.NoError(t, b.Reset(ctx, "r", db, "")) // `producer replay` meanwhile
	err = a.Save(ctx, &run, "8-x")
	require.ErrorIs(t, err, ErrFenced)

	next, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	assert.True(t, next.Found)
	assert.Equal(t, "", next.LastSeq, "the reset stands")
	require.NoError(t, a.Save(ctx, &next, "3-x"), "a run from the reset saves as usual")
}

// TestOnChangeStoreVerify: a cached checkpoint whose _local doc is gone (the db was deleted and
// recreated) is ErrMoved; the cache entry is dropped.
func TestOnChangeStoreVerify(t *testing.T) {
	a, _, db := newOnChangeStores(t)
	ctx := t.Context()
	p, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	require.NoError(t, a.Save(ctx, &p, "5-x"))
	cached, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	require.True(t, cached.cached)

	deleteDoc(t, a, "r", db) // as if the db had been recreated: no doc
	require.ErrorIs(t, a.Verify(ctx, &cached), ErrMoved)
	fresh, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	assert.False(t, fresh.Found, "forgotten: read from CouchDB, where there is none")
}

// TestOnChangeStoreLocalChanges: with LocalChanges, a doc older than LocalEvery still trails the
// entry while the changes acted on since it was written are fewer; the save that reaches
// LocalChanges writes it, and the count starts again. The count rides in the entry, so another
// process that loads it carries on counting.
func TestOnChangeStoreLocalChanges(t *testing.T) {
	a, b, db := newOnChangeStores(t)
	a.LocalEvery, b.LocalEvery = time.Nanosecond, time.Nanosecond // every doc is old
	a.LocalChanges, b.LocalChanges = 5, 5
	ctx := t.Context()
	doc := func() string {
		t.Helper()
		d, _, err := a.readDoc(ctx, "r", db)
		require.NoError(t, err)
		return d.LastSeq
	}
	p, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	p.Acted(1)
	require.NoError(t, a.Save(ctx, &p, "1-x"), "the first save writes the doc")
	require.Equal(t, "1-x", doc())
	p.Acted(2)
	require.NoError(t, a.Save(ctx, &p, "3-x"))
	assert.Equal(t, "1-x", doc(), "2 changes behind: the doc trails")

	q, err := b.Load(ctx, "r", db)
	require.NoError(t, err)
	require.Equal(t, "3-x", q.LastSeq)
	q.Acted(2)
	require.NoError(t, b.Save(ctx, &q, "5-x"))
	assert.Equal(t, "1-x", doc(), "4 changes behind, counted across processes: the doc trails")
	q.Acted(1)
	require.NoError(t, b.Save(ctx, &q, "6-x"))
	assert.Equal(t, "6-x", doc(), "5 changes behind: written")
	q.Acted(1)
	require.NoError(t, b.Save(ctx, &q, "7-x"))
	assert.Equal(t, "6-x", doc(), "the count started again")

	b.LocalChanges = 0 // LocalEvery alone: an old doc is written
	q.Acted(1)
	require.NoError(t, b.Save(ctx, &q, "8-x"))
	assert.Equal(t, "8-x", doc())
}

// TestOnChangeStoreBeginThenTrail: the doc Begin writes counts as written for LocalEvery: the
// first page's save moves the entry only (in an initial sync, a request less per db), and a lost
// entry falls back to the beginning — the first page acted on again, nothing skipped.
func TestOnChangeStoreBeginThenTrail(t *testing.T) {
	a, _, db := newOnChangeStores(t)
	a.LocalEvery = time.Hour
	ctx := t.Context()
	p, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	require.NoError(t, a.Begin(ctx, &p))
	p.Acted(3)
	require.NoError(t, a.Save(ctx, &p, "3-x"))
	doc, found, err := a.readDoc(ctx, "r", db)
	require.NoError(t, err)
	require.True(t, found, "Begin wrote the doc")
	assert.Empty(t, doc.LastSeq, "the first save left the doc at the beginning")
	cached, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	assert.Equal(t, "3-x", cached.LastSeq, "the entry holds the first page's end")
	require.NoError(t, a.Verify(ctx, &cached))

	a.Forget(ctx, "r", db)
	lost, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	assert.True(t, lost.Found)
	assert.Empty(t, lost.LastSeq, "without the entry: from the beginning again")
}

// TestOnChangeStoreLocalEvery: with LocalEvery, saves within the interval move the cache entry
// only; the _local doc trails it (what a lost entry falls back to), is still what Verify checks,
// and is written again once the interval is over. A replay still wins.
func TestOnChangeStoreLocalEvery(t *testing.T) {
	a, b, db := newOnChangeStores(t)
	a.LocalEvery, b.LocalEvery = time.Hour, time.Hour
	ctx := t.Context()
	p, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	require.NoError(t, a.Save(ctx, &p, "5-x"), "the first save writes the doc")
	require.NoError(t, a.Save(ctx, &p, "9-x"))
	require.NoError(t, a.Save(ctx, &p, "11-x"))

	doc, _, err := a.readDoc(ctx, "r", db)
	require.NoError(t, err)
	assert.Equal(t, "5-x", doc.LastSeq, "the doc trails the entry")
	q, err := b.Load(ctx, "r", db)
	require.NoError(t, err)
	assert.Equal(t, "11-x", q.LastSeq, "another process reads the entry")
	require.NoError(t, b.Verify(ctx, &q), "the trailing doc is still the entry's")

	b.LocalEvery = time.Nanosecond // the interval is over
	require.NoError(t, b.Save(ctx, &q, "13-x"))
	doc, _, err = a.readDoc(ctx, "r", db)
	require.NoError(t, err)
	assert.Equal(t, "13-x", doc.LastSeq, "written again once the interval is over")

	run, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	require.NoError(t, b.Reset(ctx, "r", db, "2-x"))
	require.ErrorIs(t, a.Save(ctx, &run, "20-x"), ErrFenced, "a replay wins over a deferred save")

	a.Forget(ctx, "r", db)
	lost, err := a.Load(ctx, "r", db)
	require.NoError(t, err)
	assert.Equal(t, "2-x", lost.LastSeq, "without the entry, the doc is read")
}
