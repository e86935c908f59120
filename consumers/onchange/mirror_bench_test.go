package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

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
// Each write is a read of the key and a conditional write.
func BenchmarkMirrorPage(b *testing.B) {
	ns := natstest.Start(b)
	nc, js := ns.Connect(b)
	log := logrus.New()
	log.SetOutput(io.Discard)
	for _, block := range []bool{true, false} {
		b.Run(fmt.Sprintf("block=%t", block), func(b *testing.B) {
			r, err := rules.Parse("mir", fmt.Appendf(nil, `{"type":"on_change","mirror":"BENCH","block":%t}`, block))
			require.NoError(b, err)
			h := &handler{mirrors: newMirrorWriter(js, 1, nc.MaxPayload), dead: &noDeadLetters{}, log: log,
				inlineRetry: time.Second, book: newRetryBook(), requestConcurrency: 10}
			page := make([]couch.Change, 100)
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				for j := range page {
					id, rev := fmt.Sprintf("doc%03d", j), fmt.Sprintf("%d-%032x", i+1, j)
					page[j] = couch.Change{Seq: fmt.Sprint(i*100 + j + 1), ID: id, Revs: []string{rev},
						Doc: fmt.Appendf(nil, `{"_id":%q,"_rev":%q,"n":%d,"text":"some payload text"}`, id, rev, i)}
				}
				res := h.processBatch(b.Context(), "db", r.(*rules.OnChange), "", "", page, log)
				require.NoError(b, res.err)
				require.Equal(b, len(page), res.done)
			}
			b.ReportMetric(float64(b.N*len(page))/b.Elapsed().Seconds(), "docs/s")
		})
	}
}

// racingKV is a mirror bucket where another writer changes a key between the mirror's read and
// its write, once per key.
type racingKV struct {
	jetstream.KeyValue
	keyRace // over the updates
}

// keyRace counts a fault-injecting bucket's writes and tells which is a key's first: the one
// raced.
type keyRace struct {
	mu     sync.Mutex
	raced  map[string]bool
	writes int
}

// first records a write of key and reports whether it is the key's first.
func (k *keyRace) first(key string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.raced == nil {
		k.raced = map[string]bool{}
	}
	first := !k.raced[key]
	k.raced[key] = true
	k.writes++
	return first
}

func (r *racingKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	if last == 0 { // a creation: not raced here (see deletingKV)
		return r.KeyValue.Update(ctx, key, value, last)
	}
	if r.first(key) {
		if _, err := r.KeyValue.Put(ctx, key, []byte(`{"_rev":"9-other"}`)); err != nil {
			return 0, err
		}
	}
	return r.KeyValue.Update(ctx, key, value, last)
}

// deletingKV is a mirror bucket where a successor deletes each key (a drop of the db, or a
// deleted doc) between the mirror's read and its first write of that key, leaving a delete marker.
type deletingKV struct {
	jetstream.KeyValue
	keyRace
	refused int
}

func (d *deletingKV) write(ctx context.Context, key string, w func() (uint64, error)) (uint64, error) {
	first := d.first(key)
	if first {
		if err := d.KeyValue.Delete(ctx, key); err != nil {
			return 0, err
		}
	}
	rev, err := w()
	if err != nil && first {
		d.mu.Lock()
		d.refused++
		d.mu.Unlock()
	}
	return rev, err
}

func (d *deletingKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	return d.write(ctx, key, func() (uint64, error) { return d.KeyValue.Update(ctx, key, value, last) })
}

func (d *deletingKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	return d.write(ctx, key, func() (uint64, error) { return d.KeyValue.Create(ctx, key, value, opts...) })
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

// TestMirrorWriteAfterADeleteIsRefused: a key deleted between the mirror's read and its write
// (the successor of a holder paused there dropped the db, or mirrored a deleted doc) refuses the
// write, absent key or not: the write is conditional on the key's last message, delete markers
// included, so a stale holder cannot bring back what its successor deleted. The holder here still
// holds its job, so its retry, over a fresh read, writes.
func TestMirrorWriteAfterADeleteIsRefused(t *testing.T) {
	var del *deletingKV
	h, oc, _, log := mirrorTestHandler(t, func(b jetstream.KeyValue) jetstream.KeyValue {
		del = &deletingKV{KeyValue: b}
		return del
	})
	page := make([]couch.Change, 3)
	for j := range page {
		id := fmt.Sprintf("d%d", j)
		page[j] = couch.Change{Seq: fmt.Sprint(j + 1), ID: id, Revs: []string{"1-x"}, Doc: fmt.Appendf(nil, `{"_id":%q,"_rev":"1-x"}`, id)}
	}
	res := h.processBatch(t.Context(), "db", oc, "", "", page, log)
	require.NoError(t, res.err)
	require.Equal(t, 3, res.done)
	assert.Equal(t, 3, del.refused, "each write sent after the key's deletion is refused")
	assert.Equal(t, 6, del.writes, "and retried once over a fresh read")
}

// TestMirrorWritesAreConditional: a page written again (a re-dispatch) writes nothing; a key
// changed by another writer between the mirror's read and its write makes the write fail and be
// retried over a fresh read, so the change's revision ends in the key and the other write is not
// lost silently in between.
func TestMirrorWritesAreConditional(t *testing.T) {
	race := &racingKV{}
	h, oc, js, log := mirrorTestHandler(t, func(b jetstream.KeyValue) jetstream.KeyValue {
		race.KeyValue = b
		return race
	})
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
	res := h.processBatch(t.Context(), "db", oc, "", "", page(1), log) // creates: no race
	require.NoError(t, res.err)
	require.Equal(t, 5, res.done)
	before := lastSeq()
	res = h.processBatch(t.Context(), "db", oc, "", "", page(1), log)
	require.NoError(t, res.err)
	assert.Equal(t, before, lastSeq(), "the same page again writes nothing")

	res = h.processBatch(t.Context(), "db", oc, "", "", page(2), log) // every update raced once
	require.NoError(t, res.err)
	require.Equal(t, 5, res.done)
	assert.Len(t, race.raced, 5)
	assert.Equal(t, 10, race.writes, "each raced update failed and was retried over a fresh read")
	kv, err := js.KeyValue(t.Context(), "M")
	require.NoError(t, err)
	for j := range 5 {
		e, err := kv.Get(t.Context(), mirrorkey.Encode("db", fmt.Sprintf("d%d", j)))
		require.NoError(t, err)
		assert.JSONEq(t, fmt.Sprintf(`{"_id":"d%d","_rev":"2-x"}`, j), string(e.Value()))
	}
	// Each key: create, the racing write, the retried update.
	assert.Equal(t, before+10, lastSeq())
}

// TestMirrorReadsAtTheLeader: the reads that decide a mirror write (the key's last message) and a
// heal (the message at the checkpoint's sequence, the key's last) use the JetStream API's message
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
	res := h.processBatch(t.Context(), "db", oc, "", "", page, log)
	require.NoError(t, res.err)
	require.Equal(t, 2, res.done)
	cp := checkpoint.OnChangePoint{Stream: checkpoint.StreamPoint{Subject: "$KV.M." + mirrorkey.Encode("db", "d0"), Seq: 1}}
	from, err := h.healMirror(t.Context(), "db", oc, cp, "2", log)
	require.NoError(t, err)
	require.Equal(t, "2", from, "the bucket holds the checkpoint's write")
	got := calls.Stop(t)
	assert.Zero(t, got["DIRECT.GET"], "no read is a direct get: %v", got)
	assert.GreaterOrEqual(t, got["STREAM.MSG.GET"], 2, "the keys' reads and the heal's are message gets at the leader: %v", got)
}
