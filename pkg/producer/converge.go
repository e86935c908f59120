package producer

import (
	"context"
	"fmt"
	"maps"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
)

// streamScaler is the part of jetstream.JetStream that makes a stream's replicas converge.
type streamScaler interface {
	streamStater
	UpdateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error)
}

// How long convergeReplicas waits for the stream to have one replica, then all of them again,
// looking every convergePoll.
var (
	convergeWait = 15 * time.Second
	convergePoll = 250 * time.Millisecond
)

// convergeReplicas makes every replica of a replicated stream hold what its leader holds, after
// the stream watch found that it lost messages it had acknowledged (SPEC §3 "CouchDB is the
// truth"). When every NATS node comes back from an older store of its own (a power failure with
// lazy sync), the replicas can each hold other messages at the same sequences, or one a hole
// that the others do not have: JetStream compares their last sequences only and never repairs
// them. The jobs heal what the stream's leader shows (consumers/onchange healStream, healHole,
// healMirror), but a later leader shows its own history, and removals by sequence remove
// different messages on each replica, so heals done under one leader can undo themselves under
// the next.
//
// So the stream is scaled to one replica, which JetStream does keeping its leader, then back to
// want: the new replicas are copies of the leader's store, and the jobs the sweep enqueues heal
// that one history. Until the new replicas caught up the stream runs on fewer copies; that is
// the cost of a loss that already happened, not of every sweep. A stream with one replica, or
// none wanted (want < 2), is left as it is. It returns once the stream has want replicas again,
// without waiting for the new ones to catch up (the jobs heal the leader's history meanwhile). A
// converge stopped half-way (the producer killed, NATS down) leaves the stream with fewer
// replicas than want: the next sweep's restoreReplicas scales it back.
//
// key is the stream metadata key that records the rebuild (rebuiltKey after a loss, resetKey for
// a stuck replica); a rebuild recorded under either keeps every producer from rebuilding the
// stream again for rebuildQuiet: either makes every replica a copy of the leader's store.
func convergeReplicas(ctx context.Context, js streamScaler, name string, want int, key string, log logrus.FieldLogger) error {
	if want < 2 {
		return nil
	}
	st, err := js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("read stream %s: %w", name, err)
	}
	if cfg := st.CachedInfo().Config; time.Since(stampedAt(cfg, rebuiltKey)) < rebuildQuiet || time.Since(stampedAt(cfg, resetKey)) < rebuildQuiet {
		return nil // rebuilt a moment ago (by another producer, for the same reason, or for the other)
	} else if cfg.Replicas > 1 {
		// Recorded at this step already: another producer that sees the same loss or stuck
		// replica a moment later leaves the rebuild to this one.
		cfg.Replicas = 1
		cfg.Metadata = maps.Clone(cfg.Metadata)
		if cfg.Metadata == nil {
			cfg.Metadata = map[string]string{}
		}
		cfg.Metadata[key] = time.Now().UTC().Format(time.RFC3339Nano)
		if _, err := js.UpdateStream(ctx, cfg); err != nil {
			return fmt.Errorf("scale stream %s to one replica (to rebuild the others from its leader): %w", name, err)
		}
		if err := waitReplicas(ctx, js, name, 1, false, convergeWait); err != nil {
			log.WithError(err).Warn("stream " + name + " did not come down to one replica in time: scaling it back anyway")
		}
	}
	if err := restoreReplicas(ctx, js, name, want, key, time.Now()); err != nil {
		return err
	}
	if err := waitReplicas(ctx, js, name, want, false, convergeWait); err != nil {
		return err
	}
	log.Warnf("stream %s rebuilt from its leader: its other %d replicas are new copies of the leader's store", name, want-1)
	return nil
}

// rebuiltKey is the stream metadata key in which the producer that rebuilt a stream's replicas
// records when (RFC 3339): every producer watching the stream reads it (see rebuiltAt), so that
// the leader term the rebuild makes, and the notices of the loss it rebuilt for, rebuild nothing
// more, whichever producer did it.
const rebuiltKey = "spiegel_rebuilt_at"

// rebuiltAt is when the replicas of the stream of cfg were last rebuilt after a loss (zero:
// never).
func rebuiltAt(cfg jetstream.StreamConfig) time.Time { return stampedAt(cfg, rebuiltKey) }

// stampedAt is the time the stream metadata of cfg records at key (zero: none).
func stampedAt(cfg jetstream.StreamConfig, key string) time.Time {
	t, _ := time.Parse(time.RFC3339Nano, cfg.Metadata[key])
	return t
}

// restoreReplicas scales stream name to want replicas when it has fewer configured (a converge
// stopped half-way, or the second step of one: then rebuilt is when, recorded in the stream's
// metadata at key, else zero). It does nothing otherwise.
func restoreReplicas(ctx context.Context, js streamScaler, name string, want int, key string, rebuilt time.Time) error {
	st, err := js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("read stream %s: %w", name, err)
	}
	cfg := st.CachedInfo().Config
	if cfg.Replicas >= want {
		return nil
	}
	cfg.Replicas = want
	if !rebuilt.IsZero() {
		cfg.Metadata = maps.Clone(cfg.Metadata)
		if cfg.Metadata == nil {
			cfg.Metadata = map[string]string{}
		}
		cfg.Metadata[key] = rebuilt.UTC().Format(time.RFC3339Nano)
	}
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		return fmt.Errorf("scale stream %s back to %d replicas: %w", name, want, err)
	}
	return nil
}

// waitReplicas waits until stream name has a leader and n replicas in all, and with current
// until every one of them is current with the leader.
func waitReplicas(ctx context.Context, js streamStater, name string, n int, current bool, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	t := time.NewTicker(convergePoll)
	defer t.Stop()
	var last string
	for {
		st, err := js.Stream(ctx, name)
		if err == nil {
			c := st.CachedInfo().Cluster
			switch {
			case c == nil || c.Leader == "":
				last = "no leader"
			case len(c.Replicas) != n-1:
				last = fmt.Sprintf("%d replicas", len(c.Replicas)+1)
			default:
				cur := 1
				for _, p := range c.Replicas {
					if p.Current && !p.Offline {
						cur++
					}
				}
				if !current || cur == n {
					return nil
				}
				last = fmt.Sprintf("%d of %d replicas current", cur, n)
			}
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("stream %s: want %d replicas, %s after %s", name, n, last, within)
		case <-t.C:
		}
	}
}

// repair runs after each look of the watch. After a loss for certain (w.certain) it makes the
// replicas of the stream converge on its leader's history (convergeReplicas); otherwise it scales
// back a stream left with fewer replicas than want by a converge stopped half-way. want is the
// replicas configured (SPIEGEL_STREAM_REPLICAS), or more where the stream had more at the look.
// It logs what fails: the next sweep tries again.
func (w *streamWatch) repair(ctx context.Context, want int, log logrus.FieldLogger) {
	js, ok := w.js.(streamScaler)
	if !ok || w.replicas == 0 {
		return
	}
	want = max(want, w.replicas)
	var err error
	switch {
	case w.certain:
		if err = convergeReplicas(ctx, js, w.name, want, rebuiltKey, log); err == nil {
			w.relook(ctx)
		}
	case w.replicas < want && time.Since(w.stamped) < shortFor:
		// a rebuild began a moment ago (this producer's or another's): it scales back itself
	case w.replicas < want:
		log.Warnf("stream %s has %d replicas, %d wanted (a rebuild stopped half-way): scaling it back", w.name, w.replicas, want)
		if err = restoreReplicas(ctx, js, w.name, want, "", time.Time{}); err == nil {
			w.relook(ctx)
		}
	}
	if err != nil && ctx.Err() == nil {
		log.WithError(err).Warn("rebuild the replicas of stream " + w.name + " failed: the next sweep tries again")
	}
}

// relook takes the stream's leader term and replicas after a rebuild, so that the next look
// compares with the rebuilt stream.
func (w *streamWatch) relook(ctx context.Context) {
	st, err := w.js.Stream(ctx, w.name)
	if err != nil {
		return
	}
	if t := termOf(st.CachedInfo().Cluster); t.leader != "" {
		w.term = t
	}
	w.replicas = st.CachedInfo().Config.Replicas
}
