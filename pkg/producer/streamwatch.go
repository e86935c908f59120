package producer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
)

// streamStater is the part of jetstream.JetStream the stream watch uses.
type streamStater interface {
	Stream(ctx context.Context, name string) (jetstream.Stream, error)
}

// streamWatch notices, from one sweep to the next, that our changes stream (SPIEGEL_CHANGES,
// which install created) lost messages it had acknowledged: NATS restarted from a store older
// than what it acknowledged (lazy sync and a power failure), or the stream deleted. It only
// reads the stream's info and, at most, one message; it changes nothing.
//
// What counts as a loss, from one look to the next: the stream is gone; its last sequence went
// back; the message at the remembered last sequence is another one (the sequence was given again
// to a later message); or it has more gaps between its first and last message than before (a
// message deleted in the middle: nothing of ours deletes one). A message dropped by the stream's
// own limits (max age, max bytes) is no loss: the remembered sequence is then below the stream's
// first, and the gaps only go.
//
// On a loss the sweep reports it (metric, log, `producer status`) and enqueues every db of a
// subject rule: each job reads its subject and publishes again, after what the stream still
// holds and in feed order, the changes it had stored there that are gone (consumers/onchange
// checkStream). That deletes and reorders nothing.
type streamWatch struct {
	js   streamStater
	name string

	looked  bool
	seq     uint64    // the stream's last sequence at the previous look (0: none yet, or empty)
	at      time.Time // the time of that message
	deleted uint64    // its gaps then (messages missing between its first and last)
}

// lost looks at the stream and reports whether it lost messages since the previous look, and
// why. The first look is the baseline.
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
	deleted := uint64(state.NumDeleted)
	lost, why := false, ""
	switch {
	case !w.looked || w.seq == 0:
	case state.LastSeq < w.seq:
		lost, why = true, fmt.Sprintf("stream %s went back from sequence %d to %d", w.name, w.seq, state.LastSeq)
	case w.seq >= state.FirstSeq && state.LastSeq > w.seq:
		m, err := st.GetMsg(ctx, w.seq)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			// deleted since: the gaps tell
		case err != nil:
			return false, "", fmt.Errorf("read message %d of stream %s: %w", w.seq, w.name, err)
		case !m.Time.Equal(w.at):
			lost, why = true, fmt.Sprintf("stream %s holds another message at sequence %d than before", w.name, w.seq)
		}
	case w.seq == state.LastSeq && !state.LastTime.Equal(w.at):
		lost, why = true, fmt.Sprintf("stream %s holds another message at sequence %d than before", w.name, w.seq)
	}
	if !lost && w.looked && deleted > w.deleted {
		lost, why = true, fmt.Sprintf("stream %s has %d gaps between its first and last message, %d before", w.name, deleted, w.deleted)
	}
	w.seq, w.at, w.deleted, w.looked = state.LastSeq, state.LastTime, deleted, true
	return lost, why, nil
}

// replicaInterval is how often the producer's watchReplicas reads the streams' infos.
const replicaInterval = time.Minute

// watchReplicas reports, every interval until ctx ends, how many replicas of each of
// streams (ours: install created them) are offline or not current, in the gauge set (a metric
// labelled by stream), with a warning when a stream's count goes up. It never changes a stream:
// a replica that cannot catch up is the NATS operator's to remove (nats stream cluster
// peer-remove). A stream it cannot read is skipped until the next look.
func watchReplicas(ctx context.Context, js streamStater, streams []string, every time.Duration, set func(stream string, behind int), log logrus.FieldLogger) {
	was := map[string]int{}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		for _, name := range streams {
			st, err := js.Stream(ctx, name)
			if err != nil {
				continue
			}
			n := replicasBehind(st.CachedInfo().Cluster)
			set(name, n)
			if n > was[name] {
				log.WithFields(logrus.Fields{"stream": name, "behind": n}).Warn("replicas of the stream are offline or not current: see nats stream info; Spiegel does not repair them (runbook SpiegelStreamReplicaBehind)")
			}
			was[name] = n
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// replicasBehind counts the replicas of c (not the leader) that are offline or not current.
func replicasBehind(c *jetstream.ClusterInfo) int {
	n := 0
	if c == nil {
		return 0
	}
	for _, r := range c.Replicas {
		if r != nil && (r.Offline || !r.Current) {
			n++
		}
	}
	return n
}
