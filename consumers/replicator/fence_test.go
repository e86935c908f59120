package main

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// newKVFence returns a fence on a NATS server of its own with the topology installed.
func newKVFence(t *testing.T) *kvFence {
	t.Helper()
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	topo := natsjs.DefaultTopology("")
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	return &kvFence{js: js, topo: topo}
}

// TestKVFence: the token of a replication is the revision of its key-value entry; a run that
// read it advances it once, and a run that read it before cannot advance it any more.
func TestKVFence(t *testing.T) {
	t.Parallel()
	f := newKVFence(t)
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

// answerLost is a JetStream whose first bucket lookup never gets its answer, as when the NATS
// node that took the request dies: nats.go then waits for the request's deadline. That fault
// comes from a node killed at the right moment, which a test cannot time, so it is injected here.
type answerLost struct {
	jetstream.JetStream
	lookups atomic.Int64
}

func (a *answerLost) KeyValue(ctx context.Context, bucket string) (jetstream.KeyValue, error) {
	if a.lookups.Add(1) == 1 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return a.JetStream.KeyValue(ctx, bucket)
}

// TestKVFenceLostAnswerHoldsNoOtherRun: a run whose bucket lookup lost its answer, under a run
// deadline of 10 minutes (SPIEGEL_REPLICATION_TIMEOUT), gives up after fenceTimeout, and the
// other runs read their tokens meanwhile. The lookup used to hold the fence's lock with the run's
// deadline: every native job of the process waited behind it (a chaos run saw 20 jobs held for
// minutes after a NATS node was killed).
func TestKVFenceLostAnswerHoldsNoOtherRun(t *testing.T) {
	t.Parallel()
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	topo := natsjs.DefaultTopology("")
	require.NoError(t, natsjs.Ensure(t.Context(), js, topo))
	lossy := &answerLost{JetStream: js}
	f := &kvFence{js: lossy, topo: topo}
	run, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()

	first := make(chan error, 1)
	go func() {
		_, err := f.Token(run, "first")
		first <- err
	}()
	require.Eventually(t, func() bool { return lossy.lookups.Load() == 1 }, 10*time.Second, time.Millisecond)
	other := make(chan error, 1)
	go func() {
		_, err := f.Token(run, "other")
		other <- err
	}()
	select {
	case err := <-other:
		require.NoError(t, err, "another run reads its token while the first waits")
	case <-time.After(fenceTimeout / 2):
		t.Fatal("another run waited behind the lost answer")
	}
	select {
	case err := <-first:
		assert.ErrorIs(t, err, context.DeadlineExceeded, "the run with the lost answer gives up at fenceTimeout")
	case <-time.After(2 * fenceTimeout):
		t.Fatal("the run with the lost answer waited past fenceTimeout")
	}
}

// A replication's token is keyed by its source db as well, so dropping a deleted db's cached
// checkpoints drops its tokens: nothing of the db stays in the bucket, a run of the earlier
// incarnation cannot advance the token any more, and other dbs keep theirs.
func TestKVFenceTokensGoWithTheirDB(t *testing.T) {
	t.Parallel()
	f := newKVFence(t)
	js, topo := f.js, f.topo
	gone := worker.ContextWithJob(t.Context(), &worker.Job{DB: "userdb-1"})
	kept := worker.ContextWithJob(t.Context(), &worker.Job{DB: "userdb-2"})

	old, ok, err := f.Advance(gone, "abc", 0)
	require.NoError(t, err)
	require.True(t, ok)
	other, ok, err := f.Advance(kept, "def", 0)
	require.NoError(t, err)
	require.True(t, ok)

	kv, err := natsjs.OnChangeBucket(t.Context(), js, topo)
	require.NoError(t, err)
	dropper, err := checkpoint.NewCacheDropper(t.Context(), js, kv)
	require.NoError(t, err)
	require.NoError(t, dropper.DropDB(t.Context(), "userdb-1"))

	cur, err := f.Token(gone, "abc")
	require.NoError(t, err)
	assert.Zero(t, cur, "the deleted db's token is gone")
	_, ok, err = f.Advance(gone, "abc", old)
	require.NoError(t, err)
	assert.False(t, ok, "a run of the deleted incarnation advanced a token")
	cur, err = f.Token(kept, "def")
	require.NoError(t, err)
	assert.Equal(t, other, cur, "another db's token went too")
	info, err := kv.Status(t.Context())
	require.NoError(t, err)
	assert.Equal(t, uint64(1), info.Values(), "entries left besides the other db's token")
}
