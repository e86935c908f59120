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

// A new leader of the changes stream counts as a possible loss: the on_change dbs are enqueued
// so that their jobs check what they published, and nothing is rebuilt. For a while after a loss
// for certain it counts as one: then its replicas may each hold other messages, and the stream's
// replicas are rebuilt from the new leader.
func TestStreamWatchNewLeaderAfterALoss(t *testing.T) {
	at := time.Now()
	s := &watchedStream{info: jetstream.StreamInfo{Cluster: &jetstream.ClusterInfo{Leader: "n1", LeaderSince: &at}}}
	s.info.State.FirstSeq, s.info.State.LastSeq, s.info.State.LastTime = 1, 10, at
	w := &streamWatch{js: stater{s}, name: "SPIEGEL_CHANGES", gaps: true}
	type seen struct{ lost, certain bool }
	look := func() seen {
		lost, _, err := w.lost(t.Context())
		require.NoError(t, err)
		return seen{lost, w.certain}
	}
	assert.Equal(t, seen{}, look(), "first look: a baseline")
	s.info.Cluster.Leader = "n2"
	assert.Equal(t, seen{true, false}, look(), "a new leader without a loss before it: the jobs check")
	assert.Equal(t, seen{}, look(), "the same leader again")
	since := at.Add(time.Minute)
	s.info.Cluster.LeaderSince = &since
	assert.Equal(t, seen{true, false}, look(), "the same leader elected again")

	s.info.State.LastSeq = 5 // went back: a loss
	assert.Equal(t, seen{true, true}, look())
	s.info.Cluster.Leader = "n3"
	s.info.State.LastSeq = 7
	assert.Equal(t, seen{true, true}, look(), "a new leader after the loss")
	assert.Equal(t, seen{}, look(), "the same leader again")

	w.suspect = time.Now().Add(-time.Second) // an hour later
	s.info.Cluster.Leader = "n1"
	assert.Equal(t, seen{true, false}, look(), "a new leader long after the loss")
}
