package main

import (
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// TestMirrorFromScratchWritesWithoutReads: a job that began a db's mirror from scratch (it dropped
// the db's keys: mirrorPoint.begin) knows every key of the db it writes, so its writes go at once
// without a read of their key, and a doc deleted before it ever was mirrored leaves nothing in the
// bucket, not even a delete marker. A doc the job wrote and that is deleted in a later page is
// deleted. Once a later job claimed the db, the job's writes are refused and its batch ends fenced.
// On one server, and on a three-node cluster with a replicated bucket that takes atomic batches.
func TestMirrorFromScratchWritesWithoutReads(t *testing.T) {
	t.Parallel()
	t.Run("R1", func(t *testing.T) {
		t.Parallel()
		ns := natstest.Start(t)
		nc, js := ns.Connect(t)
		_, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "M", History: 1})
		require.NoError(t, err)
		mirrorFromScratch(t, ns.URL(), nc, js)
	})
	t.Run("R3 atomic", func(t *testing.T) {
		t.Parallel()
		servers := natstest.StartCluster(t, 3)
		nc, js := servers[0].Connect(t)
		var err error
		require.Eventually(t, func() bool { // a cluster just started may not place an R3 stream yet
			_, err = js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "M", History: 1, Replicas: 3})
			return err == nil
		}, 30*time.Second, 100*time.Millisecond, "create the bucket: %v", err)
		st, err := js.Stream(t.Context(), "KV_M")
		require.NoError(t, err)
		cfg := st.CachedInfo().Config
		cfg.AllowAtomicPublish = true
		_, err = js.UpdateStream(t.Context(), cfg)
		require.NoError(t, err)
		mirrorFromScratch(t, servers[0].URL(), nc, js)
	})
}

func mirrorFromScratch(t *testing.T, url string, nc *nats.Conn, js jetstream.JetStream) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	r, err := rules.Parse("mir", []byte(`{"type":"on_change","mirror":"M","retry":`+fastRetry+`}`))
	require.NoError(t, err)
	oc := r.(*rules.OnChange)
	h := &handler{mirrors: newMirrorWriter(js, 1, nc.MaxPayload), dead: &noDeadLetters{}, log: log,
		inlineRetry: time.Second, book: newRetryBook(), requestConcurrency: 10}
	doc := func(i int, rev string, deleted bool) couch.Change {
		id := fmt.Sprintf("d%02d", i)
		c := couch.Change{Seq: fmt.Sprint(i + 1), ID: id, Revs: []string{rev}, Deleted: deleted}
		if !deleted {
			c.Doc = fmt.Appendf(nil, `{"_id":%q,"_rev":%q,"n":%d}`, id, rev, i)
		}
		return c
	}

	job := claimedJob(t, h, "db")
	mirrorPointOf(job, "M").begin()
	counter := natstest.NewAPICounter(t, url)
	var first []couch.Change
	for i := range 20 {
		first = append(first, doc(i, "1-a", i >= 15)) // d15…d19 were deleted before the mirror began
	}
	res := h.processBatch(job, "db", oc, "", "", first, log)
	require.NoError(t, res.err)
	require.Equal(t, 20, res.done)
	second := []couch.Change{doc(0, "2-a", true), doc(1, "2-a", false), doc(19, "2-a", true)}
	res = h.processBatch(job, "db", oc, "20", "", second, log)
	require.NoError(t, res.err)
	require.Equal(t, 3, res.done)
	calls := counter.Stop(t)
	assert.Zero(t, calls["STREAM.MSG.GET"]+calls["DIRECT.GET"], "no key is read: %v", calls)

	st, err := js.Stream(t.Context(), "KV_M")
	require.NoError(t, err)
	last := func(i int) (*jetstream.RawStreamMsg, error) {
		return st.GetLastMsgForSubject(t.Context(), "$KV.M."+mirrorkey.Encode("db", fmt.Sprintf("d%02d", i)))
	}
	for i := 15; i < 20; i++ {
		_, err := last(i)
		assert.ErrorIs(t, err, jetstream.ErrMsgNotFound, "d%02d, deleted before the mirror began, leaves nothing", i)
	}
	m, err := last(0)
	require.NoError(t, err)
	assert.Equal(t, "DEL", m.Header.Get("KV-Operation"), "d00, written and then deleted, is deleted")
	m, err = last(1)
	require.NoError(t, err)
	assert.Contains(t, string(m.Data), `"2-a"`, "d01 holds its latest revision")
	for i := 2; i < 15; i++ {
		m, err := last(i)
		require.NoError(t, err)
		assert.Contains(t, string(m.Data), `"1-a"`)
	}

	claimedJob(t, h, "db") // a later job of the db
	res = h.processBatch(job, "db", oc, "23", "", []couch.Change{doc(30, "1-a", false), doc(31, "1-a", false)}, log)
	require.True(t, errors.Is(res.err, errFenced), "%v", res.err)
	assert.Zero(t, res.done)
	_, err = last(30)
	assert.ErrorIs(t, err, jetstream.ErrMsgNotFound, "nothing written after the later claim")
	_, err = last(31)
	assert.ErrorIs(t, err, jetstream.ErrMsgNotFound, "nothing written after the later claim")
}
