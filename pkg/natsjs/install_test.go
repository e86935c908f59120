package natsjs

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// Ensure creates what is missing and leaves what exists as it is: an operator's edits of a
// stream, a bucket and a consumer survive it (SPEC §3 "Hands off").
func TestEnsureKeepsWhatExists(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := DefaultTopology("")
	require.NoError(t, Ensure(t.Context(), js, topo))

	// The operator's edits: `nats stream edit SPIEGEL_CHANGES --max-age 30d`, a smaller
	// max_ack_pending, a history of 5 in the checkpoint cache.
	changes := streamConfig(t, js, "SPIEGEL_CHANGES")
	changes.MaxAge = 30 * 24 * time.Hour
	_, err := js.UpdateStream(t.Context(), changes)
	require.NoError(t, err)
	cons, err := js.Consumer(t.Context(), "SPIEGEL_WORK", events.GroupReplicate.ConsumerName())
	require.NoError(t, err)
	ccfg := cons.CachedInfo().Config
	ccfg.MaxAckPending = 50
	_, err = js.UpdateConsumer(t.Context(), "SPIEGEL_WORK", ccfg)
	require.NoError(t, err)
	kvStream := streamConfig(t, js, "KV_"+topo.Subjects.OnChangeBucket())
	kvStream.MaxMsgsPerSubject = 5
	_, err = js.UpdateStream(t.Context(), kvStream)
	require.NoError(t, err)
	// And a missing one: the dead-letter stream deleted.
	require.NoError(t, js.DeleteStream(t.Context(), "SPIEGEL_DEADLETTER"))

	require.NoError(t, Ensure(t.Context(), js, topo))

	assert.Equal(t, 30*24*time.Hour, streamConfig(t, js, "SPIEGEL_CHANGES").MaxAge, "the edited max age")
	cons, err = js.Consumer(t.Context(), "SPIEGEL_WORK", events.GroupReplicate.ConsumerName())
	require.NoError(t, err)
	assert.Equal(t, 50, cons.CachedInfo().Config.MaxAckPending, "the edited max_ack_pending")
	kv := streamConfig(t, js, "KV_"+topo.Subjects.OnChangeBucket())
	assert.Equal(t, int64(5), kv.MaxMsgsPerSubject, "the edited history")
	assert.False(t, kv.AllowDirect, "the bucket still reads at its leader")
	dl := streamConfig(t, js, "SPIEGEL_DEADLETTER")
	assert.Equal(t, topo.DeadLetterMaxAge, dl.MaxAge, "the missing stream is created with the topology's age")
}

// The re-creation of a lost bucket of completion records creates a missing one and never
// updates an existing one.
func TestEnsureDoneBucketOnlyCreates(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := DefaultTopology("")
	name := "KV_" + topo.Subjects.DoneBucket()

	require.NoError(t, EnsureDoneBucket(t.Context(), js, topo))
	cfg := streamConfig(t, js, name)
	assert.False(t, cfg.AllowDirect, "a created bucket reads at its leader")
	assert.Equal(t, int64(1), cfg.MaxMsgsPerSubject)

	cfg.MaxMsgsPerSubject, cfg.Description = 3, "edited by the operator"
	_, err := js.UpdateStream(t.Context(), cfg)
	require.NoError(t, err)
	require.NoError(t, EnsureDoneBucket(t.Context(), js, topo))
	got := streamConfig(t, js, name)
	assert.Equal(t, int64(3), got.MaxMsgsPerSubject)
	assert.Equal(t, "edited by the operator", got.Description)

	require.NoError(t, js.DeleteKeyValue(t.Context(), topo.Subjects.DoneBucket()))
	require.NoError(t, EnsureDoneBucket(t.Context(), js, topo))
	assert.Equal(t, int64(1), streamConfig(t, js, name).MaxMsgsPerSubject, "created again with the topology's history")
}

// The topology's settings reach what Ensure creates; a max age below a day shortens the changes'
// duplicate window, which JetStream refuses longer than the age.
func TestEnsureCreatesWithTheTopologysSettings(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := DefaultTopology("")
	topo.ChangesMaxAge, topo.DeadLetterMaxAge, topo.MaxAckPending = time.Hour, 0, 17
	require.NoError(t, Ensure(t.Context(), js, topo))

	changes := streamConfig(t, js, "SPIEGEL_CHANGES")
	assert.Equal(t, time.Hour, changes.MaxAge)
	assert.Equal(t, time.Hour, changes.Duplicates)
	assert.Equal(t, time.Duration(0), streamConfig(t, js, "SPIEGEL_DEADLETTER").MaxAge, "0: forever")
	for _, g := range events.Groups {
		c, err := js.Consumer(t.Context(), "SPIEGEL_WORK", g.ConsumerName())
		require.NoError(t, err)
		assert.Equal(t, 17, c.CachedInfo().Config.MaxAckPending, g)
	}
}

func streamConfig(t *testing.T, js jetstream.JetStream, name string) jetstream.StreamConfig {
	t.Helper()
	st, err := js.Stream(t.Context(), name)
	require.NoError(t, err, name)
	return st.CachedInfo().Config
}
