package producer

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// infoWith is a stream info with a leader and the given replicas.
func infoWith(replicas ...*jetstream.PeerInfo) *jetstream.StreamInfo {
	return &jetstream.StreamInfo{Config: jetstream.StreamConfig{Replicas: 3}, Cluster: &jetstream.ClusterInfo{Leader: "n1", Replicas: replicas}}
}

// A replica is stuck when it stays behind without its lag going down for stuckAfter; one that
// catches up, is current, or whose stream has a replica offline is not.
func TestReplicaWatchTellsStuckFromCatchingUp(t *testing.T) {
	w := &replicaWatch{behind: map[string]behindSince{}}
	t0 := time.Now()
	look := func(at time.Duration, replicas ...*jetstream.PeerInfo) []string {
		return w.stuck("S", infoWith(replicas...), t0.Add(at), map[string]bool{})
	}
	current := &jetstream.PeerInfo{Name: "n2", Current: true}

	assert.Empty(t, look(0, current, &jetstream.PeerInfo{Name: "n3", Lag: 10}), "first seen behind")
	assert.Empty(t, look(stuckAfter/2, current, &jetstream.PeerInfo{Name: "n3", Lag: 12}))
	assert.Equal(t, []string{"n3 (15 behind)"}, look(stuckAfter, current, &jetstream.PeerInfo{Name: "n3", Lag: 15}),
		"behind for stuckAfter, its lag never went down")

	w.behind = map[string]behindSince{}
	assert.Empty(t, look(0, current, &jetstream.PeerInfo{Name: "n3", Lag: 1000}))
	assert.Empty(t, look(stuckAfter/2, current, &jetstream.PeerInfo{Name: "n3", Lag: 600}))
	assert.Empty(t, look(stuckAfter, current, &jetstream.PeerInfo{Name: "n3", Lag: 700}), "caught up some since stuckAfter/2")
	assert.NotEmpty(t, look(stuckAfter*3/2, current, &jetstream.PeerInfo{Name: "n3", Lag: 650}), "then no more for stuckAfter")

	w.behind = map[string]behindSince{}
	offline := &jetstream.PeerInfo{Name: "n2", Offline: true}
	assert.Empty(t, look(0, offline, &jetstream.PeerInfo{Name: "n3", Lag: 10}))
	assert.Empty(t, look(stuckAfter, offline, &jetstream.PeerInfo{Name: "n3", Lag: 10}), "a replica offline: scaling back up needs every node")

	none := &replicaWatch{behind: map[string]behindSince{}}
	noLeader := &jetstream.StreamInfo{Cluster: &jetstream.ClusterInfo{Replicas: []*jetstream.PeerInfo{{Name: "n3", Lag: 1}}}}
	assert.Empty(t, none.stuck("S", noLeader, t0, map[string]bool{}))
	assert.Empty(t, none.stuck("S", noLeader, t0.Add(stuckAfter), map[string]bool{}), "no leader: nothing to rebuild from")
}

// stuckView shows one node's replica of every stream behind its leader, as JetStream shows a
// replica that came back from an older store and never catches up (a real server cannot be made
// to do that on demand; the chaos run's store-loss faults do), until the stream was rebuilt.
type stuckView struct {
	*scaleLog
	node string
}

func (v *stuckView) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	st, err := v.scaleLog.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	return stuckStream{Stream: st, node: v.node}, nil
}

type stuckStream struct {
	jetstream.Stream
	node string
}

func (s stuckStream) CachedInfo() *jetstream.StreamInfo {
	info := *s.Stream.CachedInfo()
	if info.Cluster == nil || !stampedAt(info.Config, resetKey).IsZero() {
		return &info
	}
	c := *info.Cluster
	c.Replicas = nil
	for _, p := range info.Cluster.Replicas {
		p := *p
		if p.Name == s.node {
			p.Current, p.Lag = false, 7
		}
		c.Replicas = append(c.Replicas, &p)
	}
	info.Cluster = &c
	return &info
}

// A stuck replica of the work stream is rebuilt from the leader: the stream goes to one replica
// and back to three, keeps every pending job and its consumers (their replicas follow), and
// delivers the jobs again, those delivered before the rebuild and not acknowledged included.
// Another producer right after rebuilds nothing.
func TestReplicaWatchRebuildsAStuckWorkStream(t *testing.T) {
	servers := natstest.StartCluster(t, 3)
	_, raw := servers[0].Connect(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	topo := natsjs.DefaultTopology("spiegel")
	topo.Replicas, topo.AckWait = 3, 2*time.Second
	require.Eventually(t, func() bool { return natsjs.Ensure(ctx, raw, topo) == nil }, 30*time.Second, 200*time.Millisecond,
		"install on the cluster")
	work := topo.Subjects.WorkStream()
	require.NoError(t, waitReplicas(ctx, raw, work, 3, true, 30*time.Second))
	jobs := natsjs.NewJobs(raw, topo.Subjects)
	for _, db := range []string{"a", "b", "c", "d"} {
		_, err := jobs.Publish(ctx, events.GroupOnChange, events.Job{DB: db})
		require.NoError(t, err)
	}
	cons, err := raw.Consumer(ctx, work, events.GroupOnChange.ConsumerName())
	require.NoError(t, err)
	batch, err := cons.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	held := 0
	for range batch.Messages() {
		held++ // delivered, never acknowledged: a job whose worker died with the rebuild
	}
	require.Equal(t, 2, held)

	st, err := raw.Stream(ctx, work)
	require.NoError(t, err)
	leader := st.CachedInfo().Cluster.Leader
	stuckNode := st.CachedInfo().Cluster.Replicas[0].Name
	js := &scaleLog{JetStream: raw}
	names := func() []string { return []string{work} }
	w := &replicaWatch{js: &stuckView{scaleLog: js, node: stuckNode}, names: names, want: 3, log: logrus.New()}
	t0 := time.Now()
	w.look(ctx, t0)
	assert.Empty(t, js.took(), "first seen behind: nothing yet")
	w.look(ctx, t0.Add(stuckAfter))
	assert.Equal(t, []int{1, 3}, js.took(), "down to the leader's copy, then back to three")

	require.NoError(t, waitReplicas(ctx, raw, work, 3, true, time.Minute), "the new replicas catch up from the leader")
	st, err = raw.Stream(ctx, work)
	require.NoError(t, err)
	info := st.CachedInfo()
	assert.Equal(t, leader, info.Cluster.Leader, "the leader kept")
	assert.EqualValues(t, 4, info.State.Msgs, "every pending job kept")
	assert.False(t, stampedAt(info.Config, resetKey).IsZero(), "the rebuild recorded in the stream's metadata")
	assert.True(t, rebuiltAt(info.Config).IsZero(), "no loss recorded: the stream watch counts none")

	require.Eventually(t, func() bool {
		ci, err := cons.Info(ctx)
		return err == nil && ci.Config.Replicas == 3 && ci.Cluster != nil && len(ci.Cluster.Replicas) == 2
	}, time.Minute, 250*time.Millisecond, "the consumer back on three replicas")
	got := map[string]bool{}
	require.Eventually(t, func() bool {
		b, err := cons.Fetch(4, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return false
		}
		for m := range b.Messages() {
			got[m.Subject()] = true
			require.NoError(t, m.Ack())
		}
		return len(got) == 4
	}, time.Minute, 100*time.Millisecond, "every job delivered again, the two held before the rebuild after AckWait")

	other := &replicaWatch{js: &stuckView{scaleLog: js, node: stuckNode}, names: names, want: 3, log: logrus.New()}
	other.look(ctx, t0)
	other.look(ctx, t0.Add(stuckAfter))
	assert.Len(t, js.took(), 2, "another producer right after: the stream shows no stuck replica any more, and it was rebuilt a moment ago")

	// A stream left with one replica (a rebuild stopped half-way) is scaled back after shortFor.
	half := info.Config
	half.Replicas = 1
	_, err = raw.UpdateStream(ctx, half)
	require.NoError(t, err)
	w.look(ctx, t0)
	assert.Len(t, js.took(), 2, "maybe a rebuild under way")
	w.look(ctx, t0.Add(shortFor))
	assert.Equal(t, []int{1, 3, 3}, js.took(), "scaled back")
	require.NoError(t, waitReplicas(ctx, raw, work, 3, true, time.Minute))
}
