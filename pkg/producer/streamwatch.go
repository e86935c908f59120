package producer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// streamStater is the part of jetstream.JetStream the stream watch uses.
type streamStater interface {
	Stream(ctx context.Context, name string) (jetstream.Stream, error)
}

// streamWatch notices, from one sweep to the next, that the changes stream lost messages it had
// acknowledged (SPEC §3 "CouchDB is the truth"): NATS nodes restarted from stores older than what
// they acknowledged (lazy sync and a power failure), or the stream deleted. The change stream
// lives only in NATS, and a subject rule publishes a lost change again only when a job of its db
// runs (see consumers/onchange healStream); a db without new writes would get none, because its
// completion record is current. So on a loss the sweep enqueues every db of an on_change rule.
//
// It remembers the stream's last sequence and the time of that message, and the number of gaps
// between its first and last message. The next look finds a loss when the stream is gone, when
// its last sequence went back, when the message now at the remembered sequence has another time
// (the sequence was given again to a later message after the loss), or when there are more gaps:
// a store copied file by file, or flushed so, can come back with a hole in the middle. A subject
// rule's job finds such a hole in its subject and heals it (consumers/onchange healHole), which
// removes messages and so makes gaps too: the sweep after a heal enqueues the on_change dbs once
// more, to no harm. A message dropped by the stream's own limits (max age) is no loss: the
// remembered sequence is then below the stream's first, and gaps only go. The first look of a
// producer has nothing to compare with: it finds a loss when the stream has gaps at all, since a
// loss before the producer's start would otherwise stay unseen. For an hour after a loss, a new
// leader of the stream counts as one too: every node restarted from its own older store can
// leave replicas that hold other messages at the same sequences (JetStream compares their last
// sequences only), and a new leader shows its own; the jobs then check what it shows. Cost per
// sweep: one stream info, one message read.
//
// A mirror bucket's stream is watched the same way (see producer.watchMirrors), without the gaps:
// a bucket keeps one message per key, so each write of a key leaves a gap where its previous one
// was.
type streamWatch struct {
	js   streamStater
	name string
	gaps bool // compare the stream's gaps (the changes stream; not a KV bucket's)

	looked  bool
	seq     uint64    // the stream's last sequence at the previous look (0: none yet, or empty)
	at      time.Time // the time of that message
	deleted uint64    // its gaps then (messages missing between its first and last)
	leader  string    // its leader then ("": not replicated, or none)
	// suspect is until when a new leader counts as a loss: after a loss the replicas of a
	// replicated stream may each have come back with other messages (every node restarted
	// from its own older store), the same sequence holding another message on each, and a
	// new leader shows its own.
	suspect time.Time
}

// suspectFor is how long after a loss a new stream leader is taken for one.
const suspectFor = time.Hour

// lost looks at the stream and reports whether it lost messages since the previous look.
func (w *streamWatch) lost(ctx context.Context) (bool, string, error) {
	st, err := w.js.Stream(ctx, w.name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		had := w.seq > 0
		w.seq, w.at, w.deleted, w.looked = 0, time.Time{}, 0, true
		return had, fmt.Sprintf("stream %s is gone", w.name), nil
	}
	if err != nil {
		return false, "", fmt.Errorf("read stream %s: %w", w.name, err)
	}
	state := st.CachedInfo().State
	lost, why := false, ""
	deleted := uint64(0)
	if w.gaps {
		deleted = uint64(state.NumDeleted)
	}
	switch {
	case !w.looked && deleted > 0:
		lost, why = true, fmt.Sprintf("stream %s has %d gaps between its first and last message (a loss in the middle, or a heal's removals)", w.name, deleted)
	case w.seq == 0:
	case state.LastSeq < w.seq:
		lost, why = true, fmt.Sprintf("stream %s went back from sequence %d to %d", w.name, w.seq, state.LastSeq)
	case w.seq >= state.FirstSeq && state.LastSeq > w.seq:
		m, err := st.GetMsg(ctx, w.seq)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			// removed since (a heal's removal, or a hole: the gaps tell)
		case err != nil:
			return false, "", fmt.Errorf("read message %d of stream %s: %w", w.seq, w.name, err)
		case !m.Time.Equal(w.at):
			lost, why = true, fmt.Sprintf("stream %s holds another message at sequence %d than before", w.name, w.seq)
		}
	case w.seq == state.LastSeq && !state.LastTime.Equal(w.at):
		lost, why = true, fmt.Sprintf("stream %s holds another message at sequence %d than before", w.name, w.seq)
	}
	if !lost && w.looked && deleted > w.deleted {
		lost, why = true, fmt.Sprintf("stream %s has %d gaps between its first and last message, %d before (a loss in the middle, or a heal's removals)", w.name, deleted, w.deleted)
	}
	leader := ""
	if c := st.CachedInfo().Cluster; c != nil {
		leader = c.Leader
	}
	if !lost && w.looked && leader != "" && w.leader != "" && leader != w.leader && time.Now().Before(w.suspect) {
		lost, why = true, fmt.Sprintf("stream %s has a new leader (%s, was %s) since it lost messages: its replicas may hold other messages each", w.name, leader, w.leader)
	}
	if lost {
		w.suspect = time.Now().Add(suspectFor)
	}
	w.seq, w.at, w.deleted, w.looked = state.LastSeq, state.LastTime, deleted, true
	if leader != "" {
		w.leader = leader
	}
	return lost, why, nil
}
