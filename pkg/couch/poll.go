package couch

import (
	"context"
	"fmt"
	"sort"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
)

// PollSeq is the Seq of every event of the poll source: polling has no server position, so a
// saved PollSeq only says "resume from a full round".
const PollSeq = "poll"

// pollFeed is the UpdatesFeed for servers without _db_updates and _global_changes: every
// PollInterval it takes a Snapshot of all (matching) dbs and emits the Diff with the previous one.
//
// On PouchDB Server (where the GET /{db} fallback runs) a GET that races a DELETE of the same db
// can bring the db back to life, empty: a server quirk that polling fewer dbs (Match) makes rarer.
type pollFeed struct {
	c   *Client
	log logrus.FieldLogger
	opt FeedOptions
}

func (p *pollFeed) Source() string { return SourcePoll }

func (p *pollFeed) state(err error) {
	if p.opt.OnState != nil {
		p.opt.OnState(err)
	}
}

// Run polls until ctx ends. The first round with since == "now" is only the baseline; with any
// other since (the beginning, or a saved position) the first round emits updated for every db,
// so that nothing written while the process was down is lost. Later rounds emit created,
// updated and deleted events, in db name order, with Seq PollSeq. A failed round is retried with
// capped, jittered backoff; a permanent error (400, 401, 403) is returned.
func (p *pollFeed) Run(ctx context.Context, since string, emit func(DBEvent) error) error {
	var prev Snapshot
	first := true
	attempt := 0
	for {
		snap, err := p.c.takeSnapshot(ctx, p.opt.Match, p.opt.PollBatch, 0)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			p.state(err)
			if IsPermanent(err) {
				return fmt.Errorf("poll dbs: %w", err)
			}
			attempt++
			delay := p.c.retry.Delay(attempt)
			p.log.WithError(err).WithFields(logrus.Fields{"attempt": attempt, "delay": delay.String()}).
				Warn("poll dbs: retrying")
			if err := backoff.Sleep(ctx, delay); err != nil {
				return err
			}
			continue
		}
		attempt = 0
		p.state(nil)
		var evs []DBEvent
		switch {
		case first && since == SinceNow:
			// baseline only
		case first:
			evs = make([]DBEvent, 0, len(snap))
			for db := range snap {
				evs = append(evs, DBEvent{DB: db, Type: EventUpdated})
			}
			sort.Slice(evs, func(i, j int) bool { return evs[i].DB < evs[j].DB })
		default:
			evs = p.confirm(ctx, prev, snap, Diff(prev, snap))
		}
		first, prev = false, snap
		for _, ev := range evs {
			ev.Seq = PollSeq
			if err := emit(ev); err != nil {
				return err
			}
		}
		p.log.WithFields(logrus.Fields{"dbs": len(snap), "events": len(evs)}).Debug("poll round done")
		if err := backoff.Sleep(ctx, p.opt.PollInterval); err != nil {
			return err
		}
	}
}

// confirm drops the updated events of evs whose db has no change since prev's seq
// (Client.ChangedSince, one _changes row): seqs are opaque, and one state can read as another
// string (a cluster's coordinator picks the shard copies that answer per request). Such a db
// keeps prev's seq in snap, so that the next round compares with the same string. It costs one
// request per updated db; a question that fails keeps the event.
func (p *pollFeed) confirm(ctx context.Context, prev, snap Snapshot, evs []DBEvent) []DBEvent {
	out := evs[:0]
	for _, ev := range evs {
		old := prev[ev.DB]
		if ev.Type == EventUpdated {
			if changed, err := p.c.ChangedSince(ctx, ev.DB, old); err == nil && !changed {
				snap[ev.DB] = old
				continue
			}
		}
		out = append(out, ev)
	}
	return out
}
