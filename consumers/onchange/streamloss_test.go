package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// TestChangeStreamLossHealed: NATS comes back from a power failure with a store older than what
// it had acknowledged (lazy sync): the change stream lost the changes d and e of a subject rule,
// while CouchDB keeps the rule's checkpoint past them. The rule's next job finds the subject's last
// message older than the one its checkpoint records, goes back to that message's feed seq, and
// publishes d and e again with the new change f: the stream ends with every change once. Without the check the rule would go on after e, and d and e would be lost for good
// (the change stream lives only in NATS; no sweep finds them).
func TestChangeStreamLossHealed(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	subject := "spiegel.changes." + events.EncodeDBName(db)
	onSubject := func() []string {
		stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
		if err != nil {
			return nil
		}
		var ids []string
		info, err := stream.Info(t.Context(), jetstream.WithSubjectFilter(subject))
		if err != nil {
			return nil
		}
		for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
			m, err := stream.GetMsg(t.Context(), seq)
			if err == nil && m.Subject == subject {
				ids = append(ids, m.Header.Get(jetstream.MsgIDHeader))
			}
		}
		return ids
	}
	revs := map[string]string{}
	put := func(ids ...string) {
		for _, id := range ids {
			revs[id] = e.Couch.Put(t, db, id, map[string]any{"v": id})
		}
		e.enqueue(t, db)
	}
	want := func(ids ...string) []string {
		out := make([]string, len(ids))
		for i, id := range ids {
			out[i] = events.ChangeMsgID(db, id, revs[id])
		}
		return out
	}

	put("a", "b", "c")
	require.Eventually(t, func() bool { return len(onSubject()) == 3 && e.caughtUp(t, "pub", db) }, 30*time.Second, 20*time.Millisecond)

	// The copy of the store that the power failure leaves, taken while NATS is down.
	store := e.NATS.StoreDir()
	saved := filepath.Join(t.TempDir(), "store")
	e.NATS.Stop()
	require.NoError(t, os.CopyFS(saved, os.DirFS(store)))
	e.NATS.StartAgain(t)

	put("d", "e")
	require.Eventually(t, func() bool { return len(onSubject()) == 5 && e.caughtUp(t, "pub", db) }, 30*time.Second, 20*time.Millisecond)
	// The rule's _local doc in CouchDB is written now (the consumer writes it at most every 30 s):
	// CouchDB is past d and e when NATS fails.
	cps := e.onChangeStore(t)
	p, err := cps.Load(t.Context(), "pub", db)
	require.NoError(t, err)
	require.NotZero(t, p.Stream.Seq, "the checkpoint records where its last change was stored")
	require.NoError(t, cps.Save(t.Context(), &p, p.LastSeq))

	// The power failure: the store comes back as the copy has it, without d and e, and the
	// checkpoint's cache entry is lost with it (the _local doc is what the next job reads).
	e.NATS.Stop()
	require.NoError(t, os.RemoveAll(store))
	require.NoError(t, os.CopyFS(store, os.DirFS(saved)))
	e.NATS.StartAgain(t)
	require.Eventually(t, func() bool { return len(onSubject()) == 3 }, 30*time.Second, 20*time.Millisecond)
	e.onChangeStore(t).Forget(t.Context(), "pub", db)

	put("f")
	require.Eventually(t, func() bool { return len(onSubject()) >= 6 && e.caughtUp(t, "pub", db) }, 60*time.Second, 20*time.Millisecond,
		"d and e published again: the subject holds %v", onSubject())
	// Every change once; a sharded db (CouchDB, q > 1) lists its docs in no global order, so the
	// order is checked as far as it is defined: what was stored before the failure stays first.
	got := onSubject()
	require.Len(t, got, 6)
	assert.ElementsMatch(t, want("a", "b", "c"), got[:3])
	assert.ElementsMatch(t, want("d", "e", "f"), got[3:], "d and e published again, f once")
}
