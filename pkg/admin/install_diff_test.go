package admin

import (
	"bytes"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// install creates what is missing and, on a second run over an untouched installation, reports
// no difference: JetStream's defaults (a max_msgs of 0 stored as -1, a duplicate window filled
// in) are not differences.
func TestInstallObjectsCreatesAndFindsNothingToReport(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := natsjs.DefaultTopology("")

	var out bytes.Buffer
	r, err := installObjects(t.Context(), js, topo, false, &out)
	require.NoError(t, err)
	for _, o := range topo.Objects() {
		assert.Contains(t, out.String(), o.String()+": created\n")
	}
	assert.Equal(t, topologyReport{}, r)

	out.Reset()
	r, err = installObjects(t.Context(), js, topo, false, &out)
	require.NoError(t, err)
	assert.Equal(t, topologyReport{}, r, "differences in an untouched installation:\n%s", out.String())
	for _, o := range topo.Objects() {
		assert.Contains(t, out.String(), o.String()+": present\n")
	}
	assert.NotContains(t, out.String(), "kept")
}

// An operator's edits survive install, which names each one; --update applies install's
// settings back and says so; a missing stream, bucket or consumer is created.
func TestInstallObjectsKeepsEditsUntilUpdate(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := natsjs.DefaultTopology("")
	topo.MaxAckPending = 200
	_, err := installObjects(t.Context(), js, topo, false, &bytes.Buffer{})
	require.NoError(t, err)

	// `nats stream edit SPIEGEL_CHANGES --max-age 30d`, a consumer's max_ack_pending lowered,
	// the checkpoint cache's direct gets turned on, a deleted bucket and consumer.
	changes := streamConfig(t, js, "SPIEGEL_CHANGES")
	changes.MaxAge = 30 * 24 * time.Hour
	changes.Description = "ours now"
	_, err = js.UpdateStream(t.Context(), changes)
	require.NoError(t, err)
	replicator := consumerConfig(t, js, events.GroupReplicate.ConsumerName())
	replicator.MaxAckPending = 50
	_, err = js.UpdateConsumer(t.Context(), "SPIEGEL_WORK", replicator)
	require.NoError(t, err)
	cache := streamConfig(t, js, "KV_"+topo.Subjects.OnChangeBucket())
	cache.AllowDirect = true
	_, err = js.UpdateStream(t.Context(), cache)
	require.NoError(t, err)
	require.NoError(t, js.DeleteKeyValue(t.Context(), topo.Subjects.DoneBucket()))
	require.NoError(t, js.DeleteConsumer(t.Context(), "SPIEGEL_WORK", events.GroupOnChange.ConsumerName()))

	var out bytes.Buffer
	r, err := installObjects(t.Context(), js, topo, false, &out)
	require.NoError(t, err)
	assert.Contains(t, out.String(), "stream SPIEGEL_CHANGES: max_age is 720h0m0s, default 168h0m0s (kept; --update applies it)\n")
	assert.Contains(t, out.String(), "consumer replicator of stream SPIEGEL_WORK: max_ack_pending is 50, default 200 (kept; --update applies it)\n")
	assert.Contains(t, out.String(), "key-value bucket "+topo.Subjects.OnChangeBucket()+": allow_direct is true, default false (kept; --update applies it)\n")
	assert.Contains(t, out.String(), "key-value bucket "+topo.Subjects.DoneBucket()+": created\n")
	assert.Contains(t, out.String(), "consumer onchange of stream SPIEGEL_WORK: created\n")
	assert.Equal(t, topologyReport{kept: 3}, r, out.String())
	assert.Equal(t, 30*24*time.Hour, streamConfig(t, js, "SPIEGEL_CHANGES").MaxAge, "the edit is kept")
	assert.Equal(t, 50, consumerConfig(t, js, events.GroupReplicate.ConsumerName()).MaxAckPending, "the edit is kept")
	assert.True(t, streamConfig(t, js, "KV_"+topo.Subjects.OnChangeBucket()).AllowDirect, "the edit is kept")
	_, err = js.KeyValue(t.Context(), topo.Subjects.DoneBucket())
	assert.NoError(t, err, "the missing bucket is created")
	assert.Equal(t, 200, consumerConfig(t, js, events.GroupOnChange.ConsumerName()).MaxAckPending, "the missing consumer is created with the topology's bound")

	out.Reset()
	r, err = installObjects(t.Context(), js, topo, true, &out)
	require.NoError(t, err)
	assert.Contains(t, out.String(), "stream SPIEGEL_CHANGES: max_age was 720h0m0s, now 168h0m0s (updated)\n")
	assert.Contains(t, out.String(), "consumer replicator of stream SPIEGEL_WORK: max_ack_pending was 50, now 200 (updated)\n")
	assert.Equal(t, topologyReport{updated: 3}, r, out.String())
	got := streamConfig(t, js, "SPIEGEL_CHANGES")
	assert.Equal(t, 7*24*time.Hour, got.MaxAge, "--update applies the default")
	assert.Equal(t, "ours now", got.Description, "--update changes only the settings that differ")
	assert.Equal(t, 200, consumerConfig(t, js, events.GroupReplicate.ConsumerName()).MaxAckPending)
	assert.False(t, streamConfig(t, js, "KV_"+topo.Subjects.OnChangeBucket()).AllowDirect)

	out.Reset()
	r, err = installObjects(t.Context(), js, topo, false, &out)
	require.NoError(t, err)
	assert.Equal(t, topologyReport{}, r, "nothing differs after --update:\n%s", out.String())
}

// What JetStream cannot change in place is reported as such and kept, also with --update, which
// still applies the rest.
func TestInstallObjectsReportsWhatCannotChange(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := natsjs.DefaultTopology("")
	// The operator created the dead-letter stream in memory, keeping records for a day.
	_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{
		Name: "SPIEGEL_DEADLETTER", Subjects: []string{topo.Subjects.DeadLetterAll()},
		Storage: jetstream.MemoryStorage, MaxAge: 24 * time.Hour,
	})
	require.NoError(t, err)

	var out bytes.Buffer
	r, err := installObjects(t.Context(), js, topo, true, &out)
	require.NoError(t, err)
	assert.Contains(t, out.String(), "stream SPIEGEL_DEADLETTER: storage is memory, default file (kept: JetStream cannot change it in place)\n")
	assert.Contains(t, out.String(), "stream SPIEGEL_DEADLETTER: max_age was 24h0m0s, now 720h0m0s (updated)\n")
	assert.Equal(t, topologyReport{kept: 1, updated: 1}, r, out.String())
	got := streamConfig(t, js, "SPIEGEL_DEADLETTER")
	assert.Equal(t, jetstream.MemoryStorage, got.Storage)
	assert.Equal(t, 30*24*time.Hour, got.MaxAge)
}

func streamConfig(t *testing.T, js jetstream.JetStream, name string) jetstream.StreamConfig {
	t.Helper()
	st, err := js.Stream(t.Context(), name)
	require.NoError(t, err, name)
	return st.CachedInfo().Config
}

func consumerConfig(t *testing.T, js jetstream.JetStream, name string) jetstream.ConsumerConfig {
	t.Helper()
	c, err := js.Consumer(t.Context(), "SPIEGEL_WORK", name)
	require.NoError(t, err, name)
	return c.CachedInfo().Config
}
