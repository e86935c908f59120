package main

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// TestMirrorDropReadsEveryKey: the drop of a db's keys (a db deleted, or created again) deletes
// every key of the db, even when the server's pending counts say 0 before the last of them. A
// three-node JetStream did so in a chaos run: the KV key listing, which ends at the first message
// whose pending count is 0, stopped after 3 of a recreated db's 20 keys, and the other 17 stayed
// in the mirror for good. A proxy plays that server here: the third message of each delivery of
// the bucket's stream says 0 pending.
func TestMirrorDropReadsEveryKey(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	proxy := s.NewProxy(t)
	proxy.RewriteReplies(natstest.ZeroPendingAt("KV_M", 3))
	nc, js := proxy.Connect(t)

	m := newMirrorWriter(js, 1, nc.MaxPayload)
	ctx := withMirrorPoints(t.Context())
	const db, other = "users/a", "users/b"
	require.NoError(t, m.claimDB(ctx, "M", db, 5*time.Second))
	kv, err := js.KeyValue(ctx, "M")
	require.NoError(t, err)
	var live []string
	for i := range 30 {
		key := mirrorkey.Encode(db, fmt.Sprintf("doc%02d", i))
		_, err := kv.PutString(ctx, key, `{"v":1}`)
		require.NoError(t, err)
		_, err = kv.PutString(ctx, mirrorkey.Encode(other, fmt.Sprintf("doc%02d", i)), `{"v":1}`)
		require.NoError(t, err)
		if i%3 == 0 {
			require.NoError(t, kv.Delete(ctx, key)) // a deleted doc: a marker, not a live key
			continue
		}
		live = append(live, key)
	}

	n, err := m.dropDB(ctx, "M", db)
	require.NoError(t, err)
	assert.Equal(t, len(live), n, "every live key of the db is deleted")
	for _, key := range live {
		_, err := kv.Get(ctx, key)
		assert.True(t, errors.Is(err, jetstream.ErrKeyDeleted) || errors.Is(err, jetstream.ErrKeyNotFound), "key %s: %v", key, err)
	}
	for i := range 30 {
		_, err := kv.Get(ctx, mirrorkey.Encode(other, fmt.Sprintf("doc%02d", i)))
		require.NoError(t, err, "another db's keys stay")
	}
	n, err = m.dropDB(ctx, "M", db)
	require.NoError(t, err)
	assert.Zero(t, n, "a second drop finds nothing to delete")
}
