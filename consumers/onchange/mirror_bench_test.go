package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// BenchmarkMirrorPage writes pages of 100 changed docs into a mirror bucket (embedded NATS): one
// write at a time ("block": true) and SPIEGEL_REQUEST_CONCURRENCY (10) at once.
// Each write is a read of the key and a write under the job's fence of the db (one claim per job).
func BenchmarkMirrorPage(b *testing.B) {
	ns := natstest.Start(b)
	nc, js := ns.Connect(b)
	log := logrus.New()
	log.SetOutput(io.Discard)
	for _, block := range []bool{true, false} {
		b.Run(fmt.Sprintf("block=%t", block), func(b *testing.B) {
			r, err := rules.Parse("mir", fmt.Appendf(nil, `{"type":"on_change","mirror":"M","block":%t}`, block))
			require.NoError(b, err)
			h := &handler{mirrors: newMirrorWriter(js, 1, nc.MaxPayload), dead: &noDeadLetters{}, log: log,
				inlineRetry: time.Second, book: newRetryBook(), requestConcurrency: 10}
			page := make([]couch.Change, 100)
			ctx := claimedJob(b, h, "db")
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				for j := range page {
					id, rev := fmt.Sprintf("doc%03d", j), fmt.Sprintf("%d-%032x", i+1, j)
					page[j] = couch.Change{Seq: fmt.Sprint(i*100 + j + 1), ID: id, Revs: []string{rev},
						Doc: fmt.Appendf(nil, `{"_id":%q,"_rev":%q,"n":%d,"text":"some payload text"}`, id, rev, i)}
				}
				res := h.processBatch(ctx, "db", r.(*rules.OnChange), "", "", page, log)
				require.NoError(b, res.err)
				require.Equal(b, len(page), res.done)
			}
			b.ReportMetric(float64(b.N*len(page))/b.Elapsed().Seconds(), "docs/s")
		})
	}
}

// bucketJS hands the mirror writer kv as every bucket.
type bucketJS struct {
	jetstream.JetStream
	kv jetstream.KeyValue
}

func (b bucketJS) KeyValue(context.Context, string) (jetstream.KeyValue, error) { return b.kv, nil }

// mirrorTestHandler returns a handler whose mirror rule "mir" writes into bucket M of an embedded
// NATS through the bucket wrap makes of it, the rule, and the connection's JetStream.
func mirrorTestHandler(t *testing.T, wrap func(jetstream.KeyValue) jetstream.KeyValue) (*handler, *rules.OnChange, jetstream.JetStream, *logrus.Logger) {
	t.Helper()
	ns := natstest.Start(t)
	nc, js := ns.Connect(t)
	log := logrus.New()
	log.SetOutput(io.Discard)
	r, err := rules.Parse("mir", []byte(`{"type":"on_change","mirror":"M","retry":`+fastRetry+`}`))
	require.NoError(t, err)
	bucket, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "M", History: 1})
	require.NoError(t, err)
	h := &handler{mirrors: newMirrorWriter(bucketJS{JetStream: js, kv: wrap(bucket)}, 1, nc.MaxPayload), dead: &noDeadLetters{}, log: log,
		inlineRetry: time.Second, book: newRetryBook(), requestConcurrency: 10}
	return h, r.(*rules.OnChange), js, log
}

// claimedJob returns a job's context in which h's mirror rules hold db in bucket M (as
// handle gives its rules).
func claimedJob(t testing.TB, h *handler, db string) context.Context {
	t.Helper()
	ctx := withMirrorPoints(withFences(t.Context()))
	require.NoError(t, h.mirrors.claimDB(ctx, "M", db, 5*time.Second))
	return ctx
}

// hookJS runs before once, before the first write published through it; every write waits
// for it.
type hookJS struct {
	kvManager
	once   sync.Once
	before func()
}

func (h *hookJS) PublishMsg(ctx context.Context, msg *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	h.once.Do(h.before)
	return h.kvManager.PublishMsg(ctx, msg, opts...)
}

// TestMirrorStaleHolderIsFenced: a holder paused between reading a key and writing it, while the
// first job of the db created again (its successor) dropped the db's keys and mirrored the new
// db, writes nothing when it resumes — not a key the successor deleted, and not a key that had no
// message at all when the successor dropped the db (an earlier db's doc, which the new db's feed
// never names: it would stay in the mirror for good; seen in a chaos run). The successor claimed
// the db, so the fence refuses every write of the earlier holder, and its batch ends fenced.
func TestMirrorStaleHolderIsFenced(t *testing.T) {
	h, oc, js, log := mirrorTestHandler(t, func(b jetstream.KeyValue) jetstream.KeyValue { return b })
	kv, err := js.KeyValue(t.Context(), "M")
	require.NoError(t, err)
	doc := func(id, rev string) couch.Change {
		return couch.Change{Seq: id, ID: id, Revs: []string{rev}, Doc: fmt.Appendf(nil, `{"_id":%q,"_rev":%q}`, id, rev)}
	}
	// The earlier db had d0 mirrored already; d1 and d2 are new to the mirror.
	first := claimedJob(t, h, "db")
	res := h.processBatch(first, "db", oc, "", "", []couch.Change{doc("d0", "1-a")}, log)
	require.NoError(t, res.err)

	stale := claimedJob(t, h, "db")
	successor := *h // another process
	successor.mirrors = newMirrorWriter(js, 1, js.Conn().MaxPayload)
	hook := &hookJS{kvManager: h.mirrors.js}
	hook.before = func() { // the successor runs while the stale holder is paused before its first write
		next := claimedJob(t, &successor, "db")
		n, err := successor.mirrors.dropDB(next, "M", "db")
		assert.NoError(t, err)
		assert.Equal(t, 1, n, "the successor drops the earlier db's one key")
		res := successor.processBatch(next, "db", oc, "", "", []couch.Change{doc("n0", "1-b")}, log)
		assert.NoError(t, res.err)
	}
	h.mirrors = newMirrorWriter(hook, 1, js.Conn().MaxPayload)
	res = h.processBatch(stale, "db", oc, "", "", []couch.Change{doc("d0", "2-a"), doc("d1", "1-a"), doc("d2", "1-a")}, log)
	require.ErrorIs(t, res.err, errFenced)
	assert.Zero(t, res.done)

	lister, err := kv.ListKeysFiltered(t.Context(), mirrorkey.DBPrefix("db"))
	require.NoError(t, err)
	var keys []string
	for k := range lister.Keys() {
		keys = append(keys, k)
	}
	assert.Equal(t, []string{mirrorkey.Encode("db", "n0")}, keys, "only the new db's doc is mirrored")
}

// TestMirrorLateHolderCannotWriteBack: a holder that lost its job to a redelivery (a lease ran
// out) and writes late cannot put older revisions over what its successor wrote, though it reads
// each key right before writing it: the successor claimed the db after it. A page written again
// by the holder of the db writes nothing.
func TestMirrorLateHolderCannotWriteBack(t *testing.T) {
	h, oc, js, log := mirrorTestHandler(t, func(b jetstream.KeyValue) jetstream.KeyValue { return b })
	page := func(gen int) []couch.Change {
		out := make([]couch.Change, 5)
		for j := range out {
			id, rev := fmt.Sprintf("d%d", j), fmt.Sprintf("%d-x", gen)
			out[j] = couch.Change{Seq: fmt.Sprint(gen*10 + j), ID: id, Revs: []string{rev}, Doc: fmt.Appendf(nil, `{"_id":%q,"_rev":%q}`, id, rev)}
		}
		return out
	}
	lastSeq := func() uint64 {
		kv, err := js.KeyValue(t.Context(), "M")
		require.NoError(t, err)
		st, err := kv.Status(t.Context())
		require.NoError(t, err)
		return st.(*jetstream.KeyValueBucketStatus).StreamInfo().State.LastSeq
	}
	late := claimedJob(t, h, "db")
	res := h.processBatch(late, "db", oc, "", "", page(1), log)
	require.NoError(t, res.err)
	require.Equal(t, 5, res.done)

	next := claimedJob(t, h, "db") // the redelivery
	res = h.processBatch(next, "db", oc, "", "", page(2), log)
	require.NoError(t, res.err)
	require.Equal(t, 5, res.done)
	before := lastSeq()
	res = h.processBatch(next, "db", oc, "", "", page(2), log)
	require.NoError(t, res.err)
	assert.Equal(t, before, lastSeq(), "the same page again writes nothing")

	res = h.processBatch(late, "db", oc, "", "", page(1), log)
	require.ErrorIs(t, res.err, errFenced)
	assert.Zero(t, res.done)
	assert.Equal(t, before, lastSeq(), "the late holder's writes were all refused")
	kv, err := js.KeyValue(t.Context(), "M")
	require.NoError(t, err)
	for j := range 5 {
		e, err := kv.Get(t.Context(), mirrorkey.Encode("db", fmt.Sprintf("d%d", j)))
		require.NoError(t, err)
		assert.JSONEq(t, fmt.Sprintf(`{"_id":"d%d","_rev":"2-x"}`, j), string(e.Value()))
	}
}

// TestMirrorReadsAtTheLeader: the reads that decide a mirror write (the key's last message) and a
// gap check (the message at the checkpoint's sequence, the key's last) use the JetStream API's message
// get, which only the bucket stream's leader answers — never direct gets, which KV buckets allow
// by default and which any replica answers, one that lags behind the leader included. Read so, in
// a chaos run on a three-node JetStream, a doc whose key a heal had just deleted still showed its
// revision, its write was skipped as done, and the doc stayed missing from the mirror.
func TestMirrorReadsAtTheLeader(t *testing.T) {
	h, oc, js, log := mirrorTestHandler(t, func(b jetstream.KeyValue) jetstream.KeyValue { return b })
	st, err := js.Stream(t.Context(), "KV_M")
	require.NoError(t, err)
	require.True(t, st.CachedInfo().Config.AllowDirect, "the bucket allows direct gets, as KV buckets do by default")
	calls := natstest.NewAPICounter(t, js.Conn().ConnectedUrl())
	page := []couch.Change{
		{Seq: "1", ID: "d0", Revs: []string{"1-x"}, Doc: []byte(`{"_id":"d0","_rev":"1-x"}`)},
		{Seq: "2", ID: "d1", Revs: []string{"2-x"}, Deleted: true},
	}
	ctx := claimedJob(t, h, "db")
	res := h.processBatch(ctx, "db", oc, "", "", page, log)
	require.NoError(t, res.err)
	require.Equal(t, 2, res.done)
	point := mirrorPointOf(ctx, "M").point()
	require.NotNil(t, point)
	cp := checkpoint.OnChangePoint{Stream: *point}
	require.NoError(t, h.checkMirror(t.Context(), "db", oc, &checkpointWriter{cp: cp}, log), "the bucket holds the checkpoint's write")
	got := calls.Stop(t)
	assert.Zero(t, got["DIRECT.GET"], "no read is a direct get: %v", got)
	assert.GreaterOrEqual(t, got["STREAM.MSG.GET"], 2, "the keys' reads and the gap check's are message gets at the leader: %v", got)
}
