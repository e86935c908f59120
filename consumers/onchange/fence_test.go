package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// publishPage runs h's rule on rows of db "db" from since within ctx (one job's context), once
// the subject was checked, as a job does before each page.
func publishPage(t testing.TB, ctx context.Context, h *handler, r *rules.OnChange, since string, rows []couch.Change) batchResult {
	t.Helper()
	ok, err := h.publisher.check(ctx, "db", r, h.dead, h.log)
	require.NoError(t, err)
	require.True(t, ok)
	return h.processBatch(ctx, "db", r, since, "", rows, h.log)
}

func docRow(seq, id, rev string) couch.Change {
	return couch.Change{Seq: seq, ID: id, Revs: []string{rev}, Doc: []byte(`{}`)}
}

// TestStaleHolderPublishesAreRefused: instance A publishes a page of a subject rule, then its NATS
// connection freezes (a partition: no byte moves, nothing closes) with its next page on the way:
// doc y at 1-a and doc x at 1-a. Instance B, which took the job over, publishes the db's feed as it
// now is: y at 1-a and x at 2-b (x changed since). When A's connection thaws, its held page reaches
// the stream after B's. The fence refuses it: the stream holds x at 2-b last, as the feed does,
// and A's run ends with errFenced. Without the fence A's x at 1-a is stored after x at 2-b: a
// service rebuilding its state from the stream would end with the old revision. y is A's page's
// first change and a duplicate of B's, so a check on the first message of a page alone would
// let the rest of it through.
func TestStaleHolderPublishesAreRefused(t *testing.T) {
	t.Parallel()
	for _, mode := range publishModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			s := natstest.Start(t)
			js := orderStream(t, s, 0, mode.atomic)
			proxy := s.NewProxy(t)
			ncA, err := nats.Connect(proxy.URL(), nats.ReconnectBufSize(-1))
			require.NoError(t, err)
			t.Cleanup(ncA.Close)
			jsA, err := jetstream.New(ncA)
			require.NoError(t, err)
			hA, r := orderHandler(t, jsA)
			hB, _ := orderHandler(t, js)

			jobA := withFences(t.Context())
			first := []couch.Change{docRow("1", "a", "1-a"), docRow("2", "b", "1-a")}
			require.NoError(t, publishPage(t, jobA, hA, r, "", first).err)

			proxy.Freeze()
			late := make(chan batchResult, 1)
			go func() {
				late <- publishPage(t, jobA, hA, r, "2", []couch.Change{docRow("3", "y", "1-a"), docRow("4", "x", "1-a")})
			}()
			require.Eventually(t, func() bool { return proxy.HeldBytes() > 0 }, 10*time.Second, time.Millisecond, "A's page is on its way")

			jobB := withFences(t.Context())
			res := publishPage(t, jobB, hB, r, "2", []couch.Change{docRow("3", "y", "1-a"), docRow("5", "x", "2-b")})
			require.NoError(t, res.err)
			require.Equal(t, 2, res.done)

			proxy.Thaw()
			select {
			case res := <-late:
				assert.True(t, errors.Is(res.err, errFenced), "A's run ends fenced: %v", res.err)
				assert.Zero(t, res.done, "A's checkpoint does not move")
			case <-time.After(30 * time.Second):
				t.Fatal("A's page did not end")
			}
			assert.Equal(t, []string{"db/a/1-a", "db/b/1-a", "db/y/1-a", "db/x/2-b"}, stored(t, js),
				"nothing of A's late page is stored after B's")
		})
	}
}

// TestFencedJobRunsAgain: a job whose first publish finds a message it did not know of (another
// instance's, stored after the job read the subject) ends with errFenced; the job's next run
// reads the subject afresh and publishes, its changes already stored deduplicated. A window
// (publishWindow) whose head the other instance stored already, the same changes at the very
// sequences the window expects them at, goes on right after them instead: its next change expects
// the one before it by sequence and message id, which only an identical stream tail satisfies.
func TestFencedJobRunsAgain(t *testing.T) {
	t.Parallel()
	for _, mode := range publishModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			s := natstest.Start(t)
			js := orderStream(t, s, 0, mode.atomic)
			h, r := orderHandler(t, js)
			other, _ := orderHandler(t, js)

			job := withFences(t.Context())
			require.NoError(t, publishPage(t, job, h, r, "", []couch.Change{docRow("1", "a", "1-a"), docRow("2", "b", "1-a")}).err)
			require.NoError(t, publishPage(t, withFences(t.Context()), other, r, "", []couch.Change{docRow("3", "c", "1-a"), docRow("4", "d", "1-a")}).err)

			page := []couch.Change{docRow("3", "c", "1-a"), docRow("4", "d", "1-a"), docRow("5", "e", "1-a")}
			res := publishPage(t, job, h, r, "2", page)
			if !mode.atomic { // a window
				require.NoError(t, res.err)
				assert.Equal(t, 3, res.done)
				assert.Equal(t, []string{"db/a/1-a", "db/b/1-a", "db/c/1-a", "db/d/1-a", "db/e/1-a"}, stored(t, js), "each once, in order")
				return
			}
			assert.True(t, errors.Is(res.err, errFenced), "%v", res.err)
			assert.Zero(t, res.done)

			res = publishPage(t, withFences(t.Context()), h, r, "2", page) // the job's next run
			require.NoError(t, res.err)
			assert.Equal(t, 3, res.done)
			assert.Equal(t, []string{"db/a/1-a", "db/b/1-a", "db/c/1-a", "db/d/1-a", "db/e/1-a"}, stored(t, js), "each once, in order")
		})
	}
}

// TestSharedSubjectIsNotFenced: a rule whose subject has no ${db_name} is shared by the jobs of
// every db it matches, which publish at once; its publishes carry no expectation, so the jobs do
// not refuse each other.
func TestSharedSubjectIsNotFenced(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := orderStream(t, s, 0, true)
	h, _ := orderHandler(t, js)
	r, err := rules.Parse("shared", []byte(`{"type":"on_change","subject":"chg.all","timeout_ms":2000}`))
	require.NoError(t, err)
	rule := r.(*rules.OnChange)
	require.False(t, h.publisher.fenceable(rule, "db"))
	job1, job2 := withFences(t.Context()), withFences(t.Context())
	require.NoError(t, publishPage(t, job1, h, rule, "", []couch.Change{docRow("1", "a", "1-a"), docRow("2", "b", "1-a")}).err)
	require.NoError(t, publishPage(t, job2, h, rule, "", []couch.Change{docRow("1", "c", "1-a"), docRow("2", "d", "1-a")}).err)
	require.NoError(t, publishPage(t, job1, h, rule, "2", []couch.Change{docRow("3", "e", "1-a"), docRow("4", "f", "1-a")}).err)
	assert.Len(t, stored(t, js), 6)
}

// lostAnswerPublisher stores every publish but loses the answer of the lose-th one (1-based): the
// publisher sees an error although the stream stored the message, as when the connection or the
// stream's leader goes down between the two.
type lostAnswerPublisher struct {
	jetstream.JetStream
	lose  int
	calls int
}

func (p *lostAnswerPublisher) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	p.calls++
	ack, err := p.JetStream.PublishMsg(ctx, m, opts...)
	if err == nil && p.calls == p.lose {
		return nil, nats.ErrTimeout
	}
	return ack, err
}

// TestDuplicateAnswerMovesTheStreamPoint: on a replicated stream (a three-node JetStream, where
// the leader checks a message id before the expected last sequence; a single server refuses the
// retry as fenced instead) the answer of b's publish is lost after the stream stored it, and the
// retry is answered "duplicate" at b's sequence. The checkpoint's stream point
// is b's message all the same, so when our changes stream later loses that message (a node that
// had not written it to disk leads after a crash), the next job sees the loss and publishes b
// again after a.
// Before, a duplicate answer left the point at a's message: the loss of b's was not seen, the
// checkpoint was past b, and b never reached the stream (a chaos run on a three-node JetStream
// ended with one change missing so, the stream's only hole).
func TestDuplicateAnswerMovesTheStreamPoint(t *testing.T) {
	t.Parallel()
	servers := natstest.StartCluster(t, 3)
	_, js := servers[0].Connect(t)
	require.Eventually(t, func() bool {
		_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "CHG_CHANGES", Subjects: []string{"chg.>"},
			Duplicates: time.Hour, Storage: jetstream.FileStorage, Replicas: 3})
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "the replicated stream is created")
	pub := &lostAnswerPublisher{JetStream: js, lose: 2}
	h, r := orderHandler(t, pub)

	job := withFences(t.Context())
	res := publishPage(t, job, h, r, "", []couch.Change{docRow("1", "a", "1-a")})
	require.NoError(t, res.err)
	res = publishPage(t, job, h, r, "1", []couch.Change{docRow("2", "b", "1-a")})
	require.NoError(t, res.err)
	require.Equal(t, 1, res.done)
	require.Equal(t, []string{"db/a/1-a", "db/b/1-a"}, stored(t, js), "b stored once: the retry was a duplicate")
	pt := h.streamPoint(job, "db", r)
	require.NotNil(t, pt)
	assert.Equal(t, uint64(2), pt.Seq, "the stream point is b's message, which holds the job's last change")

	// The stream loses b's message; the next job starts from the checkpoint (past b).
	st, err := js.Stream(t.Context(), "CHG_CHANGES")
	require.NoError(t, err)
	require.NoError(t, st.DeleteMsg(t.Context(), 2))
	cps := &checkpointWriter{cp: checkpoint.OnChangePoint{LastSeq: "2", Stream: *pt}}
	next := withFences(t.Context())
	from, err := h.checkStream(next, "db", r, cps, "2", h.log)
	require.NoError(t, err)
	assert.Equal(t, "1", from, "the loss is seen: the job goes back to a's feed seq and publishes b again")
}

// TestRulesSharingAStreamEachStoreTheChange: two rules of one db publish the same change to two
// subjects of one stream, the db's own and another. The stream deduplicates by message id across
// its subjects, so with one id for both (<db>/<doc id>/<rev>, as before) the second publish was
// answered "duplicate" and its subject never got the change. The other subject's id names it
// (events.Subjects.ChangeMsgIDOn): each subject holds the change once, each rule's stream point
// is its own message, and a re-dispatch of either is still a duplicate.
func TestRulesSharingAStreamEachStoreTheChange(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := orderStream(t, s, 0, false)
	h, own := orderHandler(t, js)
	r, err := rules.Parse("other", []byte(`{"type":"on_change","subject":"chg.other.${db_name}","timeout_ms":2000}`))
	require.NoError(t, err)
	other := r.(*rules.OnChange)
	for _, rule := range []*rules.OnChange{other, own, other, own} { // each twice: the second is a re-dispatch
		job := withFences(t.Context())
		res := publishPage(t, job, h, rule, "", []couch.Change{docRow("1", "a", "1-a")})
		require.NoError(t, res.err, rule.ID())
		require.Equal(t, 1, res.done, rule.ID())
	}
	assert.Equal(t, []string{"@chg.other.db/db/a/1-a", "db/a/1-a"}, stored(t, js), "the change once on each subject")

	job := withFences(t.Context())
	require.NoError(t, publishPage(t, job, h, own, "", []couch.Change{docRow("1", "a", "1-a")}).err)
	pt := h.streamPoint(job, "db", own)
	require.NotNil(t, pt)
	assert.Equal(t, uint64(2), pt.Seq, "the db's own subject holds the change: its message is the rule's stream point")
	from, err := h.checkStream(withFences(t.Context()), "db", own, &checkpointWriter{cp: checkpoint.OnChangePoint{LastSeq: "1", Stream: *pt}}, "1", h.log)
	require.NoError(t, err)
	assert.Equal(t, "1", from, "no loss found")
}

// busyOncePublisher answers the first publish with JetStream's 10164 (a check on the subject
// while another write on it is in flight, replicated streams only) and then publishes.
type busyOncePublisher struct {
	jetstream.JetStream
	calls int
}

func (p *busyOncePublisher) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	p.calls++
	if p.calls == 1 {
		return nil, &jetstream.APIError{Code: 400, ErrorCode: 10164, Description: "wrong last sequence"}
	}
	return p.JetStream.PublishMsg(ctx, m, opts...)
}

// TestSubjectBusyIsRetriedNotFenced: a fenced publish answered 10164 was not refused by the
// fence (nothing was checked): it is retried with the rule's policy and stored, and the job
// goes on. Before, it ended the job as fenced and ran it again from its checkpoint.
func TestSubjectBusyIsRetriedNotFenced(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := orderStream(t, s, 0, false)
	pub := &busyOncePublisher{JetStream: js}
	h, r := orderHandler(t, pub)
	res := publishPage(t, withFences(t.Context()), h, r, "", []couch.Change{docRow("1", "a", "1-a"), docRow("2", "b", "1-a")})
	require.NoError(t, res.err)
	assert.Equal(t, 2, res.done)
	assert.Equal(t, []string{"db/a/1-a", "db/b/1-a"}, stored(t, js), "stored once each, in order")
	assert.Equal(t, 3, pub.calls, "the busy publish was sent again")
}
