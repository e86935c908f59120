package producer

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// scaleLog records the replicas of every stream update it passes on.
type scaleLog struct {
	jetstream.JetStream
	mu      sync.Mutex
	updates []int
}

func (s *scaleLog) UpdateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	s.mu.Lock()
	s.updates = append(s.updates, cfg.Replicas)
	s.mu.Unlock()
	return s.JetStream.UpdateStream(ctx, cfg)
}

func (s *scaleLog) took() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int(nil), s.updates...)
}

// After a loss the watch rebuilds the replicas of a replicated stream from its leader: the stream
// goes to one replica and back to three, keeps every message its leader held, and takes new
// ones. A rebuild stopped half-way (the stream left at one replica) is scaled back by the next
// look. Replicas that came back from a power failure each with another history cannot be made
// on demand; the chaos run's nats-store-loss-all makes them.
func TestStreamWatchRebuildsReplicasAfterALoss(t *testing.T) {
	servers := natstest.StartCluster(t, 3)
	_, raw := servers[0].Connect(t)
	js := &scaleLog{JetStream: raw}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	cfg := jetstream.StreamConfig{Name: "SPIEGEL_CHANGES", Subjects: []string{"spiegel.changes.>"}, Replicas: 3, Storage: jetstream.FileStorage}
	require.Eventually(t, func() bool { _, err := raw.CreateStream(ctx, cfg); return err == nil }, 30*time.Second, 100*time.Millisecond,
		"create an R3 stream on the cluster")
	require.NoError(t, waitReplicas(ctx, raw, cfg.Name, 3, true, 30*time.Second))
	for i := range 50 {
		_, err := raw.Publish(ctx, "spiegel.changes.db", fmt.Appendf(nil, "%d", i))
		require.NoError(t, err)
	}

	log := logrus.New()
	w := &streamWatch{js: js, name: cfg.Name, gaps: true}
	lost, _, err := w.lost(ctx)
	require.NoError(t, err)
	require.False(t, lost, "first look: no gaps, a baseline")
	assert.Equal(t, 3, w.replicas)
	w.repair(ctx, 3, log)
	assert.Empty(t, js.took(), "no loss, all replicas: nothing to do")

	w.noticed.Store(true) // a job found the stream without a message it had published
	lost, _, err = w.lost(ctx)
	require.NoError(t, err)
	require.True(t, lost)
	require.True(t, w.certain)
	w.repair(ctx, 3, log)
	assert.Equal(t, []int{1, 3}, js.took(), "down to the leader's copy, then back to three")
	// Another producer watching the stream: the rebuild's new leader term, and notices of the
	// loss, rebuild nothing more.
	other := &streamWatch{js: js, name: cfg.Name, gaps: true, looked: true, term: leaderTerm{leader: "elsewhere"}, suspect: time.Now().Add(time.Hour)}
	other.noticed.Store(true)
	_, _, err = other.lost(ctx)
	require.NoError(t, err)
	assert.False(t, other.certain, "another producer right after the rebuild")
	require.NoError(t, waitReplicas(ctx, raw, cfg.Name, 3, true, time.Minute), "the new replicas catch up from the leader")
	st, err := raw.Stream(ctx, cfg.Name)
	require.NoError(t, err)
	info := st.CachedInfo()
	assert.Equal(t, 3, info.Config.Replicas)
	assert.EqualValues(t, 50, info.State.Msgs, "every message the leader held")
	_, err = raw.Publish(ctx, "spiegel.changes.db", []byte("after"))
	require.NoError(t, err, "the rebuilt stream takes new messages")

	// A rebuild stopped half-way: one replica left.
	half := info.Config
	half.Replicas = 1
	_, err = raw.UpdateStream(ctx, half)
	require.NoError(t, err)
	require.NoError(t, waitReplicas(ctx, raw, cfg.Name, 1, false, 30*time.Second))
	lost, why, err := w.lost(ctx)
	require.NoError(t, err)
	require.False(t, lost, why)
	w.repair(ctx, 3, log)
	assert.Len(t, js.took(), 2, "a rebuild began a moment ago: left to scale back itself")
	defer func(d time.Duration) { shortFor = d }(shortFor)
	shortFor = 0 // the rebuild began longer ago: it stopped half-way
	w.repair(ctx, 3, log)
	require.NoError(t, waitReplicas(ctx, raw, cfg.Name, 3, true, time.Minute), "scaled back to the replicas wanted")
	st, err = raw.Stream(ctx, cfg.Name)
	require.NoError(t, err)
	assert.EqualValues(t, 51, st.CachedInfo().State.Msgs)
	assert.Equal(t, []int{1, 3, 3}, js.took(), "scaled back by the look after the half-way rebuild")

	// Jobs of the same loss tell it again after the rebuild: nothing more is rebuilt.
	w.noticed.Store(true)
	_, why, err = w.lost(ctx)
	require.NoError(t, err)
	assert.False(t, w.certain, "a notice right after a rebuild: %s", why)
	w.repair(ctx, 3, log)
	assert.Len(t, js.took(), 3)
}
