package producer

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
)

// replicaWatch rebuilds a replica that stays behind its stream's leader (SPEC §3 "CouchDB is the
// truth": NATS may lose stored data). After a NATS node came back from an older store than it
// had acknowledged (a power failure with lazy sync), JetStream can leave its replica of a stream
// behind for good: the node keeps asking its leader for a catch-up the leader does not give
// ("Expected first catchup entry to be a snapshot and peerstate, will retry" in the node's log,
// "group node unhealthy" at its /healthz) until the node restarts. Such a replica counts for
// nothing; the stream runs on the others, and when one of those goes down the stream has no
// quorum and stops. In a chaos run the work stream took and gave no job for 50 s that way, after
// the leader's node was killed with a stuck replica on another.
//
// Every replicaLook the watch reads the info of every stream of the installation. A replica
// that is online, not current, and whose lag did not go down for stuckAfter is rebuilt: the
// stream is scaled to one replica and back (convergeReplicas, which keeps the leader's store,
// and for the work stream its consumers' state), and the node gets a new copy from the leader.
// A stream with a replica offline is left as it is (scaling it back up needs every node). The
// stream's metadata records the rebuild (resetKey): for rebuildQuiet neither producer rebuilds
// it again. A stream with fewer replicas than wanted for shortFor (a rebuild stopped half-way;
// a rebuild under way is shorter) is scaled back.
// Cost: one stream info per stream per look, per producer.
type replicaWatch struct {
	js    streamScaler
	names func() []string // the streams to look at
	want  int             // SPIEGEL_STREAM_REPLICAS
	log   logrus.FieldLogger

	behind map[string]behindSince // replicas not current, by stream and node ("STREAM/node")
	short  map[string]time.Time   // streams with fewer replicas than wanted, since when
}

// behindSince is when a replica was first seen not current without going down in lag, and its
// lowest lag since.
type behindSince struct {
	since time.Time
	lag   uint64
}

// How often the replica watch looks, and how long a replica may stay behind without catching up
// before it is rebuilt. A replica that catches up (its lag goes down) is never rebuilt.
// A stream with fewer replicas than wanted is scaled back after shortFor: a rebuild, by this
// producer or another, scales it down for at most convergeWait before it scales it back.
var (
	replicaLook = 5 * time.Second
	stuckAfter  = 20 * time.Second
	shortFor    = 2 * convergeWait
)

// resetKey is the stream metadata key in which the producer that rebuilt a stuck replica records
// when (RFC 3339). Unlike rebuiltKey it tells the stream watch nothing: no message was lost.
const resetKey = "spiegel_replica_reset_at"

// run looks every replicaLook until ctx ends.
func (w *replicaWatch) run(ctx context.Context) {
	t := time.NewTicker(replicaLook)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.look(ctx, time.Now())
	}
}

// look reads every stream and rebuilds those with a stuck replica (see replicaWatch).
func (w *replicaWatch) look(ctx context.Context, now time.Time) {
	if w.behind == nil {
		w.behind, w.short = map[string]behindSince{}, map[string]time.Time{}
	}
	seen := map[string]bool{}
	for _, name := range w.names() {
		st, err := w.js.Stream(ctx, name)
		if err != nil {
			continue // gone, or NATS unreachable: the stream's own users report it
		}
		info := st.CachedInfo()
		want := max(w.want, info.Config.Replicas)
		switch at, ok := w.short[name]; {
		case info.Config.Replicas >= w.want:
			delete(w.short, name)
		case !ok:
			w.short[name] = now // maybe a rebuild under way, by this producer or another
			continue
		case now.Sub(at) < shortFor:
			continue
		default:
			delete(w.short, name)
			w.log.Warnf("stream %s has %d replicas, %d wanted (a rebuild stopped half-way): scaling it back", name, info.Config.Replicas, w.want)
			if err := restoreReplicas(ctx, w.js, name, w.want, "", time.Time{}); err != nil && ctx.Err() == nil {
				w.log.WithError(err).Warn("scale stream " + name + " back failed: the next look tries again")
			}
			continue
		}
		stuck := w.stuck(name, info, now, seen)
		if len(stuck) == 0 {
			continue
		}
		w.log.Warnf("stream %s: replica %s stayed behind its leader %s for %s without catching up: rebuilt from the leader (scaled to one replica and back to %d)",
			name, strings.Join(stuck, ", "), info.Cluster.Leader, stuckAfter, want)
		if err := convergeReplicas(ctx, w.js, name, want, resetKey, w.log); err != nil && ctx.Err() == nil {
			w.log.WithError(err).Warn("rebuild the replicas of stream " + name + " failed: the next look tries again")
		}
		for k := range w.behind {
			if strings.HasPrefix(k, name+"/") {
				delete(w.behind, k)
			}
		}
	}
	for k := range w.behind {
		if !seen[k] {
			delete(w.behind, k)
		}
	}
}

// stuck returns the replicas of stream name (its info at now) that stayed behind without
// catching up for stuckAfter, described for the log; none while a replica of the stream is
// offline or it has no leader. It records in seen the replicas it found behind.
func (w *replicaWatch) stuck(name string, info *jetstream.StreamInfo, now time.Time, seen map[string]bool) []string {
	c := info.Cluster
	if c == nil || c.Leader == "" {
		return nil
	}
	var stuck []string
	offline := false
	for _, p := range c.Replicas {
		if p.Offline {
			offline = true
			continue
		}
		if p.Current {
			continue
		}
		key := name + "/" + p.Name
		seen[key] = true
		b, ok := w.behind[key]
		if !ok || p.Lag < b.lag {
			w.behind[key] = behindSince{since: now, lag: p.Lag} // new, or catching up
			continue
		}
		if now.Sub(b.since) >= stuckAfter {
			stuck = append(stuck, fmt.Sprintf("%s (%d behind)", p.Name, p.Lag))
		}
	}
	if offline {
		return nil
	}
	return stuck
}

// streamNames are the streams of the installation the replica watch looks at: the work and
// wakeup streams, dead letters, the changes stream, the buckets of on_change checkpoints and of
// completion records, and the mirror buckets the rules name.
func (p *producer) streamNames(base []string) func() []string {
	return func() []string {
		names := append([]string(nil), base...)
		for _, b := range p.mirrorBuckets() {
			names = append(names, "KV_"+b)
		}
		return names
	}
}
