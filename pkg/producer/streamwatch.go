package producer

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
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
// completion record is current. So on a loss the sweep enqueues every db of a subject rule (of a
// mirror rule of the bucket, for a bucket's loss); a db of webhook rules only gets no job.
//
// What it sees from one look to the next:
//   - a loss, for certain: the stream is gone; its last sequence went back; the message now at
//     the remembered sequence has another time (the sequence was given again to a later message
//     after the loss); or a job told (lossNoticed: it found its subject or bucket without a
//     message it had published). Then the stream's replicas are rebuilt from its leader
//     (convergeReplicas): after every node came back from its own older store they can each hold
//     other messages at the same sequences, which JetStream never repairs, and heals done under
//     one leader would not hold under the next.
//   - a possible loss: a new leader term (another leader, or the same elected again): a loss of
//     acknowledged messages needs the nodes holding them to restart, which elects a leader, and
//     the messages lost can be the latest, after the watch's last look, where nothing else shows
//     them. More gaps between the first and last message than before (a hole in the middle, or a
//     heal's removals), and, at a producer's first look, any gap at all. The subject rules' dbs are
//     enqueued; their jobs check what their rules published and tell when they find a loss.
//
// A message dropped by the stream's own limits (max age) is no loss: the remembered sequence is
// then below the stream's first, and gaps only go. For an hour after a loss, a new leader term
// counts as a loss for certain: a new leader shows its own replica. Cost per sweep: one stream
// info, one message read; a leader change costs one job per db of a subject rule.
//
// A mirror bucket's stream is watched the same way (see producer.watchMirrors), without the gaps:
// a bucket keeps one message per key, so each write of a key leaves a gap where its previous one
// was.
type streamWatch struct {
	js   streamStater
	name string
	gaps bool // compare the stream's gaps (the changes stream; not a KV bucket's)

	looked  bool
	seq     uint64     // the stream's last sequence at the previous look (0: none yet, or empty)
	at      time.Time  // the time of that message
	deleted uint64     // its gaps then (messages missing between its first and last)
	term    leaderTerm // its leader then, and when it was elected (zero: none known)
	// replicas is the stream's configured replicas at the previous look (0: none yet, or gone).
	replicas int
	// certain tells whether the loss the last look found is certain (see above): repair rebuilds
	// the replicas of the stream only then.
	certain bool
	// stamped is the latest rebuild the stream's metadata recorded at the previous look (either
	// kind: rebuiltKey, resetKey; zero: none), so that repair does not scale back a stream that
	// a rebuild under way holds at one replica.
	stamped time.Time
	// noticed: a job told of a loss since the last look (see producer.noticeLoss).
	noticed atomic.Bool
	// suspect is until when a new leader counts as a loss: after a loss the replicas of a
	// replicated stream may each have come back with other messages (every node restarted
	// from its own older store), the same sequence holding another message on each, and a
	// new leader shows its own.
	suspect time.Time
}

// suspectFor is how long after a loss a new stream leader is taken for one.
const suspectFor = time.Hour

// rebuildQuiet is how long after a rebuild of the stream's replicas (by any producer: the
// stream's metadata records it) a job's notice of a loss, or a new leader term, rebuilds nothing
// more: the jobs enqueued for the loss find it too, and heal it in the rebuilt stream; the
// rebuild itself may elect a leader.
const rebuildQuiet = 2 * time.Minute

// lost looks at the stream and reports whether it lost messages since the previous look, or may
// have; w.certain tells which.
func (w *streamWatch) lost(ctx context.Context) (bool, string, error) {
	w.certain = false
	noticed := w.noticed.Swap(false)
	st, err := w.js.Stream(ctx, w.name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		had := w.seq > 0
		w.seq, w.at, w.deleted, w.looked, w.replicas = 0, time.Time{}, 0, true, 0
		return had, fmt.Sprintf("stream %s is gone", w.name), nil
	}
	if err != nil {
		if noticed {
			w.noticed.Store(true)
		}
		return false, "", fmt.Errorf("read stream %s: %w", w.name, err)
	}
	info := st.CachedInfo()
	state := info.State
	quiet := time.Since(rebuiltAt(info.Config)) < rebuildQuiet // rebuilt a moment ago
	noticed = noticed && !quiet
	lost, why := false, ""
	deleted := uint64(0)
	if w.gaps {
		deleted = uint64(state.NumDeleted)
	}
	switch {
	case noticed:
		lost, why = true, fmt.Sprintf("a job found stream %s without a message it had published", w.name)
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
	w.certain = lost
	term := termOf(info.Cluster)
	newTerm := w.looked && term.newAfter(w.term)
	switch {
	case lost:
	case newTerm && time.Now().Before(w.suspect) && !quiet:
		lost, why, w.certain = true, fmt.Sprintf("stream %s has a new leader (%s, was %s) since it lost messages: its replicas may hold other messages each", w.name, term, w.term), true
	case newTerm:
		lost, why = true, fmt.Sprintf("stream %s has a new leader (%s, was %s): a leader elected after its nodes restarted may lack the latest messages they acknowledged", w.name, term, w.term)
	case !w.looked && deleted > 0:
		lost, why = true, fmt.Sprintf("stream %s has %d gaps between its first and last message (a loss in the middle, or a heal's removals)", w.name, deleted)
	case w.looked && deleted > w.deleted:
		lost, why = true, fmt.Sprintf("stream %s has %d gaps between its first and last message, %d before (a loss in the middle, or a heal's removals)", w.name, deleted, w.deleted)
	}
	if w.certain {
		w.suspect = time.Now().Add(suspectFor)
	}
	w.seq, w.at, w.deleted, w.looked = state.LastSeq, state.LastTime, deleted, true
	w.replicas = info.Config.Replicas
	w.stamped = stampedAt(info.Config, rebuiltKey)
	if r := stampedAt(info.Config, resetKey); r.After(w.stamped) {
		w.stamped = r
	}
	if term.leader != "" {
		w.term = term
	}
	return lost, why, nil
}

// leaderTerm is a stream's leader and when it was elected (zero on a stream of one replica,
// whose info has none).
type leaderTerm struct {
	leader string
	since  time.Time
}

// termOf returns the leader term of a stream's cluster info (zero: none).
func termOf(c *jetstream.ClusterInfo) leaderTerm {
	if c == nil {
		return leaderTerm{}
	}
	t := leaderTerm{leader: c.Leader}
	if c.LeaderSince != nil {
		t.since = *c.LeaderSince
	}
	return t
}

// newAfter reports whether t is another term than prev: another leader, or the same elected
// again. Either unknown: no.
func (t leaderTerm) newAfter(prev leaderTerm) bool {
	switch {
	case t.leader == "" || prev.leader == "":
		return false
	case t.leader != prev.leader:
		return true
	}
	return !t.since.IsZero() && !prev.since.IsZero() && !t.since.Equal(prev.since)
}

func (t leaderTerm) String() string {
	if t.since.IsZero() {
		return t.leader
	}
	return t.leader + " elected " + t.since.UTC().Format(time.RFC3339Nano)
}
