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

	// Right after the restart an ack can go unanswered (seen on a loaded machine): the job then
	// runs again after AckWait (60 s here), so the wait covers one redelivery.
	put("d", "e")
	require.Eventually(t, func() bool { return len(onSubject()) == 5 && e.caughtUp(t, "pub", db) }, 90*time.Second, 20*time.Millisecond)
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

// TestChangeStreamAgedOutIsNotALoss: the stream drops a quiet db's changes by its max age; the
// rule's next job finds the subject empty, but the stream's first message is past the one its
// checkpoint records: nothing was lost, and only the new change is published (not the db's
// history again).
func TestChangeStreamAgedOutIsNotALoss(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	subject := "spiegel.changes." + events.EncodeDBName(db)
	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	count := func(subject string) uint64 {
		info, err := stream.Info(t.Context(), jetstream.WithSubjectFilter(subject))
		if err != nil {
			return 0
		}
		return info.State.Subjects[subject]
	}
	for _, id := range []string{"a", "b"} {
		e.Couch.Put(t, db, id, map[string]any{"v": id})
	}
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return count(subject) == 2 && e.caughtUp(t, "pub", db) }, 30*time.Second, 20*time.Millisecond)

	// Age the subject out: a short max age until it is empty, then the default again.
	cfg := stream.CachedInfo().Config
	short := cfg
	short.MaxAge, short.Duplicates = time.Second, time.Second
	_, err = e.JS.UpdateStream(t.Context(), short)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return count(subject) == 0 }, 30*time.Second, 50*time.Millisecond)
	_, err = e.JS.UpdateStream(t.Context(), cfg)
	require.NoError(t, err)
	// Another subject's message: the stream's first message is now past the rule's.
	_, err = e.JS.Publish(t.Context(), "spiegel.changes.another", []byte(`{}`))
	require.NoError(t, err)

	e.Couch.Put(t, db, "c", map[string]any{"v": "c"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return count(subject) >= 1 && e.caughtUp(t, "pub", db) }, 30*time.Second, 20*time.Millisecond)
	assert.Equal(t, uint64(1), count(subject), "only the new change: the aged-out ones are not published again")
}
