package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// The example rebuilds the state from the bucket as a mirror rule writes it (values keyed by
// mirrorkey, deletes as KV deletes), then follows live updates; -db narrows it to one db.
func TestRebuild(t *testing.T) {
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	kv, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "STATE", History: 1})
	require.NoError(t, err)
	put := func(db, id, body string) {
		_, err := kv.Put(t.Context(), mirrorkey.Encode(db, id), []byte(body))
		require.NoError(t, err)
	}
	put("orders/eu", "o.1", `{"_id":"o.1","_rev":"1-a"}`)
	put("orders/eu", "o.2", `{"_id":"o.2","_rev":"2-b"}`)
	put("orders/eu", "gone", `{"_id":"gone","_rev":"1-c"}`)
	require.NoError(t, kv.Delete(t.Context(), mirrorkey.Encode("orders/eu", "gone")))
	put("orders/us", "o.1", `{"_id":"o.1","_rev":"1-d"}`)

	for _, c := range []struct {
		db   string
		want int
	}{{"", 3}, {"orders/eu", 2}} {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		state := State{}
		ready := make(chan int, 1)
		updates := make(chan Key, 10)
		done := make(chan error, 1)
		go func() {
			done <- Rebuild(ctx, js, "STATE", c.db, state, func() { ready <- len(state) }, func(k Key, _ bool) { updates <- k })
		}()
		select {
		case n := <-ready:
			require.Equal(t, c.want, n, "db %q: docs rebuilt", c.db)
		case <-ctx.Done():
			t.Fatal("not ready within 30s")
		}
		put("orders/eu", "o.3", `{"_id":"o.3","_rev":"1-e"}`)
		select {
		case k := <-updates:
			assert.Equal(t, Key{"orders/eu", "o.3"}, k)
		case <-ctx.Done():
			t.Fatal("no live update within 30s")
		}
		cancel()
		require.NoError(t, <-done)
		assert.JSONEq(t, `{"_id":"o.3","_rev":"1-e"}`, string(state[Key{"orders/eu", "o.3"}]))
		assert.NotContains(t, state, Key{"orders/eu", "gone"}, "a deleted doc is not in the state")
		require.NoError(t, kv.Delete(t.Context(), mirrorkey.Encode("orders/eu", "o.3")))
	}
}

func TestRunNeedsABucket(t *testing.T) {
	var out strings.Builder
	err := run([]string{"-nats", "nats://127.0.0.1:1"}, &out)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "-bucket is required")
}
