package producer

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// watchedStream is a replicated stream as the watch sees it: its state and its leader. A real
// cluster whose replicas came back from a loss with other messages each cannot be made on
// demand; this stands in for its stream info.
type watchedStream struct {
	jetstream.Stream
	info jetstream.StreamInfo
}

func (s *watchedStream) CachedInfo() *jetstream.StreamInfo { return &s.info }

func (s *watchedStream) GetMsg(context.Context, uint64, ...jetstream.GetMsgOpt) (*jetstream.RawStreamMsg, error) {
	return &jetstream.RawStreamMsg{Time: s.info.State.LastTime}, nil
}

// stater hands the watch its stream.
type stater struct{ s *watchedStream }

func (st stater) Stream(context.Context, string) (jetstream.Stream, error) { return st.s, nil }

// A new leader of the changes stream counts as a loss only for a while after a loss: then its
// replicas may each hold other messages, and the new leader's view is checked by the jobs. A
// leader change without a loss before it (a node restart, a rolling upgrade) enqueues nothing.
func TestStreamWatchNewLeaderAfterALoss(t *testing.T) {
	at := time.Now()
	s := &watchedStream{info: jetstream.StreamInfo{Cluster: &jetstream.ClusterInfo{Leader: "n1"}}}
	s.info.State.FirstSeq, s.info.State.LastSeq, s.info.State.LastTime = 1, 10, at
	w := &streamWatch{js: stater{s}, name: "SPIEGEL_CHANGES", gaps: true}
	look := func() bool {
		lost, _, err := w.lost(t.Context())
		require.NoError(t, err)
		return lost
	}
	assert.False(t, look(), "first look: a baseline")
	s.info.Cluster.Leader = "n2"
	assert.False(t, look(), "a new leader without a loss before it")

	s.info.State.LastSeq = 5 // went back: a loss
	assert.True(t, look())
	s.info.Cluster.Leader = "n3"
	s.info.State.LastSeq = 7
	assert.True(t, look(), "a new leader after the loss")
	assert.False(t, look(), "the same leader again")

	w.suspect = time.Now().Add(-time.Second) // an hour later
	s.info.Cluster.Leader = "n1"
	assert.False(t, look(), "a new leader long after the loss")
}
