package main

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// ownershipWatch is how long the test watches a running producer for a change to what it did
// not create: longer than the 30 s after which an earlier release scaled a user's bucket to
// SPIEGEL_STREAM_REPLICAS.
const ownershipWatch = 40 * time.Second

// A mirror rule names a bucket its users created with one replica, on a three-node JetStream
// where Spiegel's own streams have three. The producer, its sweeps and its replica report run
// for longer than an earlier release took to scale the bucket up: it stays at one replica, with
// the settings its owner gave it, and so do our own streams (Spiegel never changes replicas).
func TestProducerLeavesAUserBucketAsItIs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	servers := natstest.StartCluster(t, 3)
	_, js := servers[0].Connect(t)
	e.cfg.NATS.NATSURL, e.cfg.NATS.StreamReplicas = servers[0].URL(), 3
	e.cfg.SweepInterval = 500 * time.Millisecond
	require.Eventually(t, func() bool {
		_, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "TEAM_DOCS", History: 1, Replicas: 1, Description: "the team's"})
		return err == nil
	}, 30*time.Second, 200*time.Millisecond, "the user's bucket is created")
	require.Contains(t, e.run(t, "install"), "install complete")
	db := e.Prefix + "owned"
	e.Couch.CreateDB(t, db)
	e.putRule(t, "mirror", map[string]any{"type": "on_change", "db_name": "^" + db + "$", "mirror": "TEAM_DOCS"})
	e.startProducer(t)

	replicas := func(stream string) (int, string) {
		st, err := js.Stream(t.Context(), stream)
		if err != nil {
			return -1, ""
		}
		return st.CachedInfo().Config.Replicas, st.CachedInfo().Config.Description
	}
	require.Never(t, func() bool {
		n, desc := replicas("KV_TEAM_DOCS")
		return n != 1 || desc != "the team's"
	}, ownershipWatch, time.Second, "the user's bucket keeps its one replica and its settings")
	n, _ := replicas("SPIEGEL_WORK")
	assert.Equal(t, 3, n, "our work stream keeps the replicas install gave it")
}
