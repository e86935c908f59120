package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// TestKVFence: the token of a replication is the revision of its key-value entry; a run that
// read it advances it once, and a run that read it before cannot advance it any more.
func TestKVFence(t *testing.T) {
	t.Parallel()
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	topo := natsjs.DefaultTopology("")
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	f := &kvFence{js: js, topo: topo}
	ctx := t.Context()

	stale, err := f.Token(ctx, "abc")
	require.NoError(t, err)
	assert.Zero(t, stale, "no token yet")
	newer, err := f.Token(ctx, "abc")
	require.NoError(t, err)
	next, ok, err := f.Advance(ctx, "abc", newer)
	require.NoError(t, err)
	require.True(t, ok, "the first run to write takes the token")
	_, ok, err = f.Advance(ctx, "abc", stale)
	require.NoError(t, err)
	assert.False(t, ok, "the run that read the token before is fenced")
	next, ok, err = f.Advance(ctx, "abc", next)
	require.NoError(t, err)
	assert.True(t, ok, "the holder goes on")
	cur, err := f.Token(ctx, "abc")
	require.NoError(t, err)
	assert.Equal(t, next, cur)
	other, err := f.Token(ctx, "def")
	require.NoError(t, err)
	assert.Zero(t, other, "one token per replication")
}
