package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSubjectReplay: a checkpoint reset by a replay with an id makes the rule publish the db's
// history again under that id (message id replay/<id>/..., header Spiegel-Replay), in feed order;
// at the end of the feed the checkpoint records the replay as done, and a later change is a
// first publication again.
func TestSubjectReplay(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	for _, id := range []string{"a", "b", "c"} {
		e.Couch.Put(t, db, id, map[string]any{"v": id})
	}
	e.enqueue(t, db)
	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	all := func() []*jetstream.RawStreamMsg {
		info, err := stream.Info(t.Context())
		require.NoError(t, err)
		var out []*jetstream.RawStreamMsg
		for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
			m, err := stream.GetMsg(t.Context(), seq)
			require.NoError(t, err)
			out = append(out, m)
		}
		return out
	}
	require.Eventually(t, func() bool { return len(all()) == 3 && e.caughtUp(t, "pub", db) }, 30*time.Second, 20*time.Millisecond)

	store := e.onChangeStore(t)
	store.ReplayID = "r1"
	require.NoError(t, store.Reset(t.Context(), "pub", db, ""))
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		p, err := store.Load(t.Context(), "pub", db)
		id, active := p.Replay()
		return err == nil && id == "r1" && !active
	}, 30*time.Second, 20*time.Millisecond, "the replay reaches the end of the feed and says so")
	msgs := all()
	require.Len(t, msgs, 6)
	// The history again, each change once: on a sharded db (CouchDB, q > 1) a second read of
	// the feed may list the docs in another order and under other seqs.
	firsts := map[string]*jetstream.RawStreamMsg{}
	for _, m := range msgs[:3] {
		firsts[m.Header.Get(jetstream.MsgIDHeader)] = m
	}
	withoutSeq := func(data []byte) map[string]any {
		var c map[string]any
		require.NoError(t, json.Unmarshal(data, &c))
		delete(c, "seq")
		return c
	}
	for _, m := range msgs[3:] {
		assert.Equal(t, "r1", m.Header.Get("Spiegel-Replay"))
		id, ok := strings.CutPrefix(m.Header.Get(jetstream.MsgIDHeader), "replay/r1/")
		require.True(t, ok, "message id %q of a replayed change", m.Header.Get(jetstream.MsgIDHeader))
		first, ok := firsts[id]
		require.True(t, ok, "replayed %s, which was not published first (or twice)", id)
		delete(firsts, id)
		assert.Equal(t, withoutSeq(first.Data), withoutSeq(m.Data), "the same change JSON")
	}
	assert.Empty(t, firsts, "every change replayed")

	e.Couch.Put(t, db, "d", map[string]any{"v": "d"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return len(all()) == 7 }, 30*time.Second, 20*time.Millisecond)
	last := all()[6]
	assert.Empty(t, last.Header.Get("Spiegel-Replay"), "a change after the replay is a first publication")
	assert.Contains(t, last.Header.Get(jetstream.MsgIDHeader), db+"/d/")
}
