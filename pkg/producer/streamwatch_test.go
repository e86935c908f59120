package producer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// The watch tells a loss of the changes stream from what its own limits drop, on a real
// server: a stream deleted, or made again with fewer messages (its last sequence went back), or
// again with as many (another message at the remembered sequence), or a message deleted in the
// middle, is a loss; the oldest messages dropped by max msgs are not. It changes nothing.
func TestStreamWatchTellsLossFromLimits(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	ctx := t.Context()
	cfg := jetstream.StreamConfig{Name: "SPIEGEL_CHANGES", Subjects: []string{"spiegel.changes.>"}, MaxMsgs: 5}
	create := func(n int) {
		// A deletion completes after its answer, and a create meanwhile returns the old stream:
		// delete and create until the stream is new.
		require.Eventually(t, func() bool {
			if err := js.DeleteStream(ctx, cfg.Name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				return false
			}
			st, err := js.CreateStream(ctx, cfg)
			return err == nil && st.CachedInfo().State.LastSeq == 0
		}, 10*time.Second, 10*time.Millisecond, "a new stream")
		publish(t, js, n)
	}
	w := &streamWatch{js: js, name: cfg.Name}
	look := func() bool {
		lost, _, err := w.lost(ctx)
		require.NoError(t, err)
		return lost
	}
	create(3)
	assert.False(t, look(), "first look: the baseline")
	publish(t, js, 4) // 7 stored, the oldest 2 dropped by max msgs
	assert.False(t, look(), "the oldest dropped by the stream's limits")

	create(4)
	assert.True(t, look(), "the last sequence went back")
	create(4)
	assert.True(t, look(), "another message at the remembered sequence")
	assert.False(t, look(), "nothing since")

	publish(t, js, 2)
	assert.False(t, look())
	st, err := js.Stream(ctx, cfg.Name)
	require.NoError(t, err)
	require.NoError(t, st.DeleteMsg(ctx, 5))
	assert.True(t, look(), "a message deleted in the middle")

	require.NoError(t, js.DeleteStream(ctx, cfg.Name))
	assert.True(t, look(), "the stream is gone")
	assert.False(t, look(), "still gone: told once")
	_, err = js.Stream(ctx, cfg.Name)
	assert.ErrorIs(t, err, jetstream.ErrStreamNotFound, "the watch never creates a stream")
}

// publish stores n messages on the changes stream's subjects.
func publish(t *testing.T, js jetstream.JetStream, n int) {
	t.Helper()
	for range n {
		_, err := js.Publish(t.Context(), "spiegel.changes.db", []byte("{}"))
		require.NoError(t, err)
	}
}

// On a three-node cluster, a replica whose server is shut down is reported behind, and the
// stream keeps its configured replicas: the watch changes nothing.
func TestWatchReplicasReportsAStoppedPeer(t *testing.T) {
	servers := natstest.StartCluster(t, 3)
	_, js := servers[0].Connect(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	cfg := jetstream.StreamConfig{Name: "SPIEGEL_WORK", Subjects: []string{"spiegel.work.>"}, Replicas: 3}
	var st jetstream.Stream
	require.Eventually(t, func() bool {
		var err error
		st, err = js.CreateStream(ctx, cfg)
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "create an R3 stream")
	info, err := st.Info(ctx)
	require.NoError(t, err)
	var victim *natstest.Server
	for _, s := range servers[1:] { // a follower on a server the test client is not connected to
		if s.Name() != info.Cluster.Leader {
			victim = s
			break
		}
	}
	require.NotNil(t, victim, "a follower outside the client's server")

	var mu sync.Mutex
	seen := map[string]int{}
	go watchReplicas(ctx, js, []string{cfg.Name}, 100*time.Millisecond, func(s string, n int) {
		mu.Lock()
		seen[s] = n
		mu.Unlock()
	}, logrus.New())
	behind := func() int { mu.Lock(); defer mu.Unlock(); return seen[cfg.Name] }
	require.Eventually(t, func() bool { mu.Lock(); _, ok := seen[cfg.Name]; mu.Unlock(); return ok && behind() == 0 }, 30*time.Second, 50*time.Millisecond, "all current at first")
	victim.Stop()
	require.Eventually(t, func() bool { return behind() == 1 }, 60*time.Second, 100*time.Millisecond, "the stopped peer is reported")
	info, err = st.Info(ctx)
	require.NoError(t, err)
	assert.Equal(t, 3, info.Config.Replicas, "the stream keeps its replicas")
}
