package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// TestChangeStreamLostTailPublishedAgain: NATS comes back from a power failure with a store older
// than what it had acknowledged (lazy sync): our changes stream lost the changes d and e of a
// subject rule, its latest on the subject, while CouchDB keeps the rule's checkpoint past them.
// The rule's next job finds the subject's last message older than the one its checkpoint
// records, reports the gap, goes back to that message's feed seq, and publishes d and e again
// after it, with the new change f: the stream ends with every change once, and nothing it
// still held is touched. Without the check the rule would go on after e, and d and e would be
// lost for good (the change stream lives only in NATS; no sweep finds them).
func TestChangeStreamLostTailPublishedAgain(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	subject := "spiegel.changes." + events.EncodeDBName(db)
	onSubject := func() []string { return e.subjectMsgIDs(t, subject) }
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
	powerFailure := e.storeCopy(t)

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
	powerFailure()
	require.Eventually(t, func() bool { return len(onSubject()) == 3 }, 30*time.Second, 20*time.Millisecond)
	e.onChangeStore(t).Forget(t.Context(), "pub", db)

	put("f")
	require.Eventually(t, func() bool { return len(onSubject()) >= 6 && e.caughtUp(t, "pub", db) }, 60*time.Second, 20*time.Millisecond,
		"d and e published again: the subject holds %v", onSubject())
	assert.Equal(t, 1.0, gapsCounted(app, gapSubject), "the gap is counted once")
	assertGapNoted(t, app, "pub", db, "lost its latest messages")
	// Every change once; a sharded db (CouchDB, q > 1) lists its docs in no global order, so the
	// order is checked as far as it is defined: what was stored before the failure stays first.
	got := onSubject()
	require.Len(t, got, 6)
	assert.ElementsMatch(t, want("a", "b", "c"), got[:3])
	assert.ElementsMatch(t, want("d", "e", "f"), got[3:], "d and e published again, f once")
}

// storeCopy takes the copy of the NATS store that a power failure leaves (NATS is stopped for
// it and started again) and returns powerFailure, which brings NATS back from that copy, as a
// server restarted from a store older than what it had acknowledged.
func (e *env) storeCopy(t *testing.T) (powerFailure func()) {
	store := e.NATS.StoreDir()
	saved := filepath.Join(t.TempDir(), "store")
	e.NATS.Stop()
	require.NoError(t, os.CopyFS(saved, os.DirFS(store)))
	e.NATS.StartAgain(t)
	return func() {
		e.NATS.Stop()
		require.NoError(t, os.RemoveAll(store))
		require.NoError(t, os.CopyFS(store, os.DirFS(saved)))
		e.NATS.StartAgain(t)
	}
}

// subjectMsgIDs returns the message ids of the change stream's messages on subject, in stream
// order (nil when the stream does not answer).
func (e *env) subjectMsgIDs(t *testing.T, subject string) []string {
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

// TestChangeStreamLossOfARecreatedDBPublishedAgain: a db is deleted and created again under its name;
// the new db's changes are published after the old db's on the same subject. NATS then comes
// back from a store older than those: the subject's last message is the old db's. Its feed seq
// means nothing in the new db (on PouchDB Server the new db's seqs start again at 1, so it
// would skip the new db's first changes, and the rule would find the loss again in every job
// without publishing them). The rule's checkpoint knows where the subject stood when it began in
// the new db, and goes back to its own start: every change of the new db is published again.
func TestChangeStreamLossOfARecreatedDBPublishedAgain(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	subject := "spiegel.changes." + events.EncodeDBName(db)
	revs := map[string]string{}
	put := func(ids ...string) {
		for _, id := range ids {
			revs[id] = e.Couch.Put(t, db, id, map[string]any{"v": id})
		}
		e.enqueue(t, db)
	}
	put("a", "b", "c")
	require.Eventually(t, func() bool { return len(e.subjectMsgIDs(t, subject)) == 3 && e.caughtUp(t, "pub", db) }, 30*time.Second, 20*time.Millisecond)

	// The db is created again; the producer drops its cached checkpoints on the deleted event.
	require.NoError(t, e.Couch.Do(t, "DELETE", "/"+couchtest.PathDB(db), nil, nil))
	e.Couch.CreateDB(t, db)
	e.onChangeStore(t).Forget(t.Context(), "pub", db)
	powerFailure := e.storeCopy(t)

	put("x", "y")
	require.Eventually(t, func() bool { return len(e.subjectMsgIDs(t, subject)) == 5 && e.caughtUp(t, "pub", db) }, 90*time.Second, 20*time.Millisecond)
	cps := e.onChangeStore(t)
	p, err := cps.Load(t.Context(), "pub", db)
	require.NoError(t, err)
	require.True(t, p.Stream.Began, "the checkpoint records where it began on the subject")
	require.NoError(t, cps.Save(t.Context(), &p, p.LastSeq))

	// The store comes back without x and y; the subject's last message is the old db's c.
	powerFailure()
	require.Eventually(t, func() bool { return len(e.subjectMsgIDs(t, subject)) == 3 }, 30*time.Second, 20*time.Millisecond)
	e.onChangeStore(t).Forget(t.Context(), "pub", db)

	put("z")
	want := []string{events.ChangeMsgID(db, "x", revs["x"]), events.ChangeMsgID(db, "y", revs["y"]), events.ChangeMsgID(db, "z", revs["z"])}
	require.Eventually(t, func() bool {
		got := e.subjectMsgIDs(t, subject)
		return len(got) >= 6 && e.caughtUp(t, "pub", db)
	}, 60*time.Second, 20*time.Millisecond, "x and y published again: the subject holds %v", e.subjectMsgIDs(t, subject))
	got := e.subjectMsgIDs(t, subject)
	require.Len(t, got, 6)
	assert.ElementsMatch(t, want, got[3:], "the new db's changes published again from its start, z once")
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
	assert.Zero(t, gapsCounted(app, gapSubject), "no gap reported")
}

// gapsCounted returns the gaps of kind that app's handler counted (spiegel_output_gaps_total).
func gapsCounted(app *consumer.App, kind string) float64 {
	return testutil.ToFloat64(app.Metrics.OutputGaps.WithLabelValues(kind))
}

// assertGapNoted checks that app's status answer names a gap of rule in db whose text holds
// what.
func assertGapNoted(t *testing.T, app *consumer.App, rule, db, what string) {
	t.Helper()
	var rep status.Report
	app.Status.Fill(&rep)
	st := rep.RuleStats[rule]
	if assert.NotNil(t, st.LastGap, "status names the rule's gap") {
		assert.Equal(t, db, st.LastGap.DB)
		assert.Contains(t, st.LastGap.Text, what)
	}
}

// subjectMessage is a message of a change subject as the tests read it.
type subjectMessage struct {
	seq      uint64
	id, pos  string
	doc, rev string
	feedSeq  string
}

// subjectMessages lists subject's messages in stream order.
func subjectMessages(t *testing.T, js jetstream.JetStream, subject string) []subjectMessage {
	t.Helper()
	stream, err := js.Stream(t.Context(), "SPIEGEL_CHANGES")
	if err != nil {
		return nil
	}
	var out []subjectMessage
	for seq := uint64(1); ; {
		m, err := stream.GetMsg(t.Context(), seq, jetstream.WithGetMsgSubject(subject))
		if err != nil {
			return out
		}
		var c changeMessage
		require.NoError(t, json.Unmarshal(m.Data, &c))
		out = append(out, subjectMessage{seq: m.Sequence, id: m.Header.Get(jetstream.MsgIDHeader), pos: m.Header.Get(events.PositionHeader),
			doc: c.ID, rev: c.Changes[0].Rev, feedSeq: c.Seq})
		seq = m.Sequence + 1
	}
}

// TestChangeStreamHoleReported: NATS comes back from a failure with a hole in the middle of a
// subject — a store copied file by file while it ran kept the later messages and lost some in
// between. Here the hole is made by removing the messages of d and e. The rule's next job finds
// the subject holding fewer messages than its last one's position says and reports it (metric,
// status naming the db and the positions); it deletes nothing and publishes nothing again: the
// readers may have read f and g, and d and e after them would break the order they rely on.
// Only the new change h is published, after g.
func TestChangeStreamHoleReported(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewOneShardDB(t, e.Prefix) // one shard: one feed order to check
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	subject := "spiegel.changes." + events.EncodeDBName(db)
	e.putAndWaitSubject(t, db, subject, 7, "a", "b", "c", "d", "e", "f", "g")
	before := subjectMessages(t, e.JS, subject)
	require.Equal(t, []string{"a", "b", "c", "d", "e", "f", "g"}, subjectDocs(before))
	for i, m := range before {
		require.Equal(t, strconv.Itoa(i+1), m.pos, "message %s carries its position on the subject", m.doc)
	}

	// The hole: d and e gone, f and g kept.
	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	require.NoError(t, stream.DeleteMsg(t.Context(), before[3].seq))
	require.NoError(t, stream.DeleteMsg(t.Context(), before[4].seq))

	e.Couch.Put(t, db, "h", map[string]any{"v": "h"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		return len(subjectMessages(t, e.JS, subject)) == 6 && e.caughtUp(t, "pub", db)
	}, 30*time.Second, 20*time.Millisecond, "h published after g")
	after := subjectMessages(t, e.JS, subject)
	assert.Equal(t, []string{"a", "b", "c", "f", "g", "h"}, subjectDocs(after), "nothing deleted, nothing published again")
	for i, m := range after[:5] {
		assert.Equal(t, append(before[:3:3], before[5:]...)[i].seq, m.seq, "message %s kept where it was", m.doc)
	}
	assert.Equal(t, "8", after[5].pos)
	assert.Equal(t, 1.0, gapsCounted(app, gapSubject), "the hole is counted once")
	assertGapNoted(t, app, "pub", db, "lacks 2 of the messages at positions 1 to 7")

	// The next job finds the same hole: it is not counted again.
	e.Couch.Put(t, db, "i", map[string]any{"v": "i"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		return len(subjectMessages(t, e.JS, subject)) == 7 && e.caughtUp(t, "pub", db)
	}, 30*time.Second, 20*time.Millisecond)
	assert.Equal(t, 1.0, gapsCounted(app, gapSubject), "one gap, counted once")
}

// subjectDocs returns the doc ids of ms.
func subjectDocs(ms []subjectMessage) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.doc)
	}
	return out
}

// TestChangeStreamOldestDroppedIsNotAHole: the stream dropped the oldest messages of a subject
// by its limits (made here with a purge of everything below c, as max age or max messages do):
// the subject holds fewer messages than its last one's position, but its first message's
// previous one is before the stream's first sequence, and the positions left follow each other.
// Only the new change is published, nothing is removed.
func TestChangeStreamOldestDroppedIsNotAHole(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewOneShardDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	subject := "spiegel.changes." + events.EncodeDBName(db)
	e.putAndWaitSubject(t, db, subject, 4, "a", "b", "c", "d")
	before := subjectMessages(t, e.JS, subject)
	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	require.NoError(t, stream.Purge(t.Context(), jetstream.WithPurgeSequence(before[2].seq)))

	e.Couch.Put(t, db, "e", map[string]any{"v": "e"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		return len(subjectMessages(t, e.JS, subject)) >= 3 && e.caughtUp(t, "pub", db)
	}, 30*time.Second, 20*time.Millisecond)
	after := subjectMessages(t, e.JS, subject)
	require.Len(t, after, 3)
	assert.Equal(t, []uint64{before[2].seq, before[3].seq}, []uint64{after[0].seq, after[1].seq}, "c and d kept")
	assert.Equal(t, "e", after[2].doc)
	assert.Equal(t, "5", after[2].pos)
	assert.Zero(t, gapsCounted(app, gapSubject), "no gap reported")
}

// TestChangeStreamOldestLostReported: NATS comes back having lost the oldest messages of a
// subject while the stream still holds older messages of other subjects (a store copied file by
// file). Made here by removing a and b. The subject's first message names a previous one that no
// limit can have dropped: the gap is reported from position 1, and nothing is deleted or
// published again.
func TestChangeStreamOldestLostReported(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewOneShardDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	subject := "spiegel.changes." + events.EncodeDBName(db)
	_, err := e.JS.Publish(t.Context(), "spiegel.changes.another", []byte(`{}`)) // an older message of another subject
	require.NoError(t, err)
	e.putAndWaitSubject(t, db, subject, 4, "a", "b", "c", "d")
	before := subjectMessages(t, e.JS, subject)
	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	require.NoError(t, stream.DeleteMsg(t.Context(), before[0].seq))
	require.NoError(t, stream.DeleteMsg(t.Context(), before[1].seq))

	e.Couch.Put(t, db, "e", map[string]any{"v": "e"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		return len(subjectMessages(t, e.JS, subject)) == 3 && e.caughtUp(t, "pub", db)
	}, 30*time.Second, 20*time.Millisecond, "e after d")
	assert.Equal(t, []string{"c", "d", "e"}, subjectDocs(subjectMessages(t, e.JS, subject)), "nothing deleted, nothing published again")
	assert.Equal(t, 1.0, gapsCounted(app, gapSubject))
	assertGapNoted(t, app, "pub", db, "lacks 2 of the messages at positions 1 to 4")
}

// putAndWaitSubject writes docs ids to db (each {"v": id}), runs the db's job, and waits until
// subject holds n messages and rule "pub" caught up.
func (e *env) putAndWaitSubject(t *testing.T, db, subject string, n int, ids ...string) {
	t.Helper()
	for _, id := range ids {
		e.Couch.Put(t, db, id, map[string]any{"v": id})
	}
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		return len(subjectMessages(t, e.JS, subject)) == n && e.caughtUp(t, "pub", db)
	}, 30*time.Second, 20*time.Millisecond)
}
