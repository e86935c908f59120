package main

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// TestRecreatedDBStartsOver: a db is deleted and recreated between two jobs while the cached
// checkpoint of the old db survives (the producer did not see the deletion: PouchDB Server has
// no _db_updates, a poll can miss a quick delete and create). The new db's seq has passed the
// stale checkpoint (on PouchDB Server seqs are integers), so its feed after that seq is not
// empty; the job still detects that the checkpoint is another db's (its _local doc is gone) and
// acts on every change of the new db, the first ones included.
func TestRecreatedDBStartsOver(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.Couch.Put(t, db, "old1", map[string]any{})
	e.Couch.Put(t, db, "old2", map[string]any{})
	s := newSink(t, nil)
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/r", "params": map[string]any{"id": "$change.id"}})
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, hasID("old2"), "old2 delivered")
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 10*time.Second, 20*time.Millisecond)
	stale, _ := e.checkpoint(t, "r", db)

	require.NoError(t, e.Couch.Do(t, http.MethodDelete, "/"+couchtest.PathDB(db), nil, nil))
	require.NoError(t, e.Couch.Do(t, http.MethodPut, "/"+couchtest.PathDB(db), nil, nil))
	for _, id := range []string{"new1", "new2", "new3", "new4"} {
		e.Couch.Put(t, db, id, map[string]any{})
	}
	cached, found := e.checkpoint(t, "r", db)
	require.True(t, found)
	require.Equal(t, stale, cached, "precondition: the old db's checkpoint is still cached")
	require.NotEmpty(t, e.changesSince(t, db, stale), "precondition: the new db's feed goes past the stale seq")

	e.enqueue(t, db)
	for _, id := range []string{"new1", "new2", "new3", "new4"} {
		s.waitHits(t, 20*time.Second, hasID(id), id+" of the recreated db delivered")
	}
}
