package producer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// doneReader reads every completion record, or one (*reconcile.Records).
type doneReader interface {
	Read(ctx context.Context) (reconcile.Done, error)
	Get(ctx context.Context, g events.Group, db string) (string, error)
}

// doneRecords is what the sweep needs of the completion records: reading them, and creating
// their bucket again when it is gone (natsjs.EnsureDoneBucket).
type doneRecords struct {
	records   doneReader
	ensure    func(ctx context.Context) error
	unchanged unchangedPairs // the (record, update_seq) pairs CouchDB said were one state (stillDue)
}

// readDone reads the completion records for one sweep. A bucket that is gone is created again
// and read as empty: every matched db gets one job, whose successes fill the new bucket. Any
// other failure is returned; the sweep then compares with the previous sweep only.
func (p *producer) readDone(ctx context.Context) (reconcile.Done, error) {
	if p.done == nil {
		return nil, errors.New("no completion records")
	}
	done, err := p.done.records.Read(ctx)
	if !errors.Is(err, reconcile.ErrNoBucket) {
		return done, err
	}
	if err := p.done.ensure(ctx); err != nil {
		return nil, err
	}
	p.log.Warn("the bucket of completion records was gone: created again; every matched db is enqueued once")
	return reconcile.Done{}, nil
}

// maxSweepSpread is the longest a sweep spreads its reads of the dbs' infos over.
const maxSweepSpread = time.Minute

// sweepSpread is how long a sweep with interval spreads its reads of the dbs' infos over
// (couch.Client.TakeSnapshotSpread, which also reads at least 200 dbs a second): a tenth of the
// interval, at most maxSweepSpread. At the default 10 m a sweep of 10,000 dbs sends its 100
// POST /_dbs_info over 50 s, one of 100,000 dbs its 1,000 over a minute; one of up to 100 dbs
// is a single request, at once.
func sweepSpread(interval time.Duration) time.Duration { return min(interval/10, maxSweepSpread) }

// sweepOnce is one reconciliation sweep (SPEC §3 "CouchDB is the truth", §4.3): it reads the
// update_seq of every matched db (couch.Client.TakeSnapshotSpread: POST /_dbs_info in batches,
// or GET /{db}, spread over sweepSpread) and the completion records (reconcile), and enqueues,
// with reason events.ReasonSweep, each (group, db) whose record is missing or differs from the
// db's update_seq. That catches both the events _db_updates dropped and whatever NATS lost
// (jobs, wakeup markers, consumer state, the records themselves), the first sweep after a start
// included; a db whose last change was processed gets no job. When the records cannot be read, a db is enqueued when its update_seq
// differs from prev, the previous sweep's snapshot (nil: none), as before there were records.
// It returns the snapshot for the next sweep (prev when the snapshot failed).
func (p *producer) sweepOnce(ctx context.Context, prev couch.Snapshot) (couch.Snapshot, error) {
	// The records first: one that changes later was written by a job that ended after the sweep
	// began, which stillDue takes as covering its db unasked.
	done, derr := p.readDone(ctx)
	if derr == nil && done == nil {
		done = reconcile.Done{} // read, and empty: every record found later is new (stillDue)
	}
	snap, err := p.couch.TakeSnapshotSpread(ctx, func(db string) bool {
		return !p.skip(db) && p.rules.Groups(db) != 0
	}, sweepSpread(p.cfg.SweepInterval))
	if err != nil {
		return prev, err
	}
	if derr != nil && ctx.Err() == nil {
		p.log.WithError(derr).Warn("read the completion records failed: this sweep enqueues the dbs changed since the previous one only")
	}
	lost := p.watchChanges(ctx) // our changes stream lost messages: the subject rules' dbs run
	if derr == nil {
		p.forgetVanished(ctx, snap, done)
	}
	dbs := make([]string, 0, len(snap))
	for db := range snap {
		dbs = append(dbs, db)
	}
	slices.Sort(dbs)
	nDue, nHeal := 0, 0
	var examples []string // the first few dbs enqueued and why, for the log
	for _, db := range dbs {
		seq := snap[db]
		groups := p.rules.Groups(db).Groups()
		var due []events.Group
		switch {
		case derr == nil:
			due = done.Due(db, seq, groups, func(g events.Group) string { return p.rules.Fingerprint(g, db) })
		case prev != nil && p.changedSincePrev(ctx, db, prev[db], seq):
			due = groups
		}
		if len(due) > 0 && derr == nil {
			due = p.stillDue(ctx, db, seq, due, done)
		}
		// Our changes stream lost messages: the db runs when a subject rule of it wrote there, and
		// a job that is running now may have looked at the stream before the loss, so a refusal
		// leaves a marker.
		heal := lost && slices.Contains(groups, events.GroupOnChange) && publishesChanges(p.rules.OnChanges(db))
		if heal {
			due = slices.DeleteFunc(due, func(g events.Group) bool { return g == events.GroupOnChange })
		}
		if len(due) == 0 && !heal {
			continue
		}
		if len(due) > 0 {
			nDue++
		}
		if heal {
			nHeal++
		}
		if len(examples) < 3 && len(due) > 0 {
			examples = append(examples, fmt.Sprintf("%s %v: record %q, update_seq %q", db, due, done[reconcile.Key(due[0], db)], seq))
		}
		if len(due) > 0 {
			p.metrics.sweepEnqueued() // the dbs behind their records only, as its help says
			if err := p.pub.EnqueueSweep(ctx, db, due); err != nil {
				return snap, err
			}
		}
		if heal {
			if err := p.pub.EnqueueNoSeq(ctx, db, events.ReasonSweep, []events.Group{events.GroupOnChange}); err != nil {
				return snap, err
			}
		}
	}
	// due: dbs not recorded done at their update_seq; heal: dbs enqueued only because our
	// changes stream lost messages (the watch's warning said so). They are counted apart: after a loss
	// nearly every db is a heal, which is not a db the pipeline left behind.
	log := p.log.WithFields(logrus.Fields{"dbs": len(snap), "due": nDue, "heal": nHeal, "first": examples})
	switch {
	case nDue > 0:
		log.Info("reconciliation sweep offered the jobs of the dbs not recorded done at their update_seq (a job pending or running refuses the offer)")
	case nHeal > 0:
		log.Info("reconciliation sweep found every matched db done; it offered a job to each db of a subject rule, whose changes stream lost messages")
	default:
		log.Debug("reconciliation sweep found every matched db done")
	}
	return snap, nil
}

// watchChanges looks at our changes stream (streamWatch) and reports whether it lost messages
// since the previous sweep: the loss is counted and logged, and its reason shown by `producer
// status`. Nothing in NATS is changed.
func (p *producer) watchChanges(ctx context.Context) bool {
	if p.changes == nil {
		return false
	}
	lost, why, err := p.changes.lost(ctx)
	switch {
	case err != nil && ctx.Err() == nil:
		p.log.WithError(err).Debug("look at the changes stream failed: the next sweep looks again")
	case lost:
		p.metrics.streamLost()
		p.noteStreamLoss(why)
		p.log.WithField("stream", p.changes.name).Warn(why + ": it lost messages it had acknowledged; every db of a subject rule is enqueued, " +
			"and each rule publishes again, after what the stream still holds, the changes of its that are gone (see the runbook SpiegelChangeStreamLoss)")
	}
	return lost
}

// publishesChanges reports whether one of ocs publishes to a subject (a webhook or mirror rule's
// output is not in the changes stream).
func publishesChanges(ocs []*rules.OnChange) bool {
	for _, r := range ocs {
		if r.Subject != "" {
			return true
		}
	}
	return false
}

// stillDue returns those of due whose record of db, read again now, still does not cover seq. A
// job that succeeded after the sweep read the records is not run again: right after a start,
// the sweep finds no record for the dbs whose rule catch-up jobs are queued or running, and by
// the time it enqueues the last of 10,000 dbs, thousands of those jobs are done (each of them
// ran twice before this check). One key-value read per due (group, db); a failed read keeps
// the group due.
//
// Seqs are opaque, and CouchDB 2+ sends one state as different strings (a _changes last_seq and
// the db's update_seq list the shards in other orders; a cluster's coordinator picks the copies
// that answer per request). A record of another string than seq is asked about instead: one
// _changes read of one row since the record (changedSince), once per distinct record of the
// db. No row: the group is done with the db as it is, and gets no job; that answer is
// remembered for the pair (record, seq) (doneRecords.unchanged), so an idle db costs one
// question, not one per sweep; a pair remembered for the record the sweep read (read) costs not
// even the key-value read. A failed question keeps the group due.
//
// A record that is not the one the sweep read (read, before the dbs' update_seqs; nil: unknown)
// was written since by a job that ended after the sweep began: it is taken as covering seq,
// unasked. Right after a start that is nearly every db the sweep reaches (bench-e2e at 1,000
// dbs: 735 questions during the initial sync, all answered "no change"; 7,833 at 10,000). Only
// a job that read its db before the sweep read the db's update_seq, and ended after the sweep
// began, can have such a record behind seq; the changes in between brought their own jobs (the
// feed, the wakeup markers), and should one of those have been lost, the next sweep finds the
// record behind the db and asks.
func (p *producer) stillDue(ctx context.Context, db, seq string, due []events.Group, read reconcile.Done) []events.Group {
	out := due[:0:0]
	answers := map[string]bool{} // record → changed since it
	for _, g := range due {
		key := reconcile.Key(g, db)
		readRec, wasRead := read[key]
		if wasRead && p.done.unchanged.said(key, readRec, seq) && !reconcile.RulesChanged(readRec, p.rules.Fingerprint(g, db)) {
			continue
		}
		rec, err := p.done.records.Get(ctx, g, db)
		switch {
		case err != nil || rec == "" || reconcile.RulesChanged(rec, p.rules.Fingerprint(g, db)):
			out = append(out, g)
			continue
		case reconcile.Covered(rec, seq) || p.done.unchanged.said(key, rec, seq):
			continue
		case read != nil && (!wasRead || rec != readRec): // written since the sweep read the dbs
			continue
		}
		changed, asked := answers[rec]
		if !asked {
			recSeq, _ := reconcile.ParseValue(rec)
			changed = p.changedSince(ctx, db, recSeq)
			answers[rec] = changed
		}
		if changed {
			p.done.unchanged.forget(key)
			out = append(out, g)
			continue
		}
		p.done.unchanged.remember(key, rec, seq)
	}
	return out
}

// changedSincePrev reports whether db, at update_seq seq now, changed since the previous sweep
// read old (a sweep without completion records): the same string is no change; another string
// is asked about (changedSince), and a db the previous sweep did not list is a change.
func (p *producer) changedSincePrev(ctx context.Context, db, old, seq string) bool {
	switch {
	case old == seq:
		return false
	case old == "":
		return true
	}
	return p.changedSince(ctx, db, old)
}

// sweepAsksPerSecond bounds the questions a sweep asks CouchDB (changedSince) per second. A
// sweep asks about every db whose completion record is another string than its update_seq,
// once per pair (stillDue): the first sweep after an initial sync, or after a start, asks about
// nearly every db. Unpaced, the sweep after bench-e2e's initial sync of 10,000 dbs asked 128 a
// second (Apache CouchDB 3.3.3, 2 cores), 8.5 of the 14.6 CouchDB requests per doc the run's
// writer wrote meanwhile. Paced, such a sweep takes 200 s and about a tenth of a core of
// CouchDB's CPU; the dbs it finds behind are enqueued as it goes.
const sweepAsksPerSecond = 50

// changedSince asks CouchDB whether db has a change after record (see stillDue); true when it
// cannot tell. The questions are paced (sweepAsksPerSecond).
func (p *producer) changedSince(ctx context.Context, db, record string) bool {
	ask := p.askChanged
	if ask == nil {
		ask = p.couch.ChangedSince
	}
	if p.asks != nil {
		if err := p.asks.Wait(ctx); err != nil {
			return true // the sweep is ending: it enqueues nothing more
		}
	}
	changed, err := ask(ctx, db, record)
	switch {
	case err != nil:
		p.metrics.sweepChecked("failed")
		if ctx.Err() == nil && !errors.Is(err, couch.ErrNotFound) {
			p.log.WithError(err).WithField("db", db).Debug("ask CouchDB for changes since the completion record failed: the db is enqueued")
		}
		return true
	case changed:
		p.metrics.sweepChecked("changed")
	default:
		p.metrics.sweepChecked("unchanged")
	}
	return changed
}

// maxVanishedChecks bounds the dbs one sweep asks CouchDB about in forgetVanished.
const maxVanishedChecks = 1000

// forgetVanished handles the dbs that have a completion record but are not in the snapshot: a
// db deleted while its "deleted" event never reached the producer (a cluster node's
// _db_updates drops events while it is down; a feed gap). Each one that CouchDB confirms gone
// (GET /{db}: 404) is forgotten as a deleted event does it: its records and cached on_change
// checkpoints are dropped (off this path), and an on_change rule that keeps a mirror gets a job,
// which deletes the db's keys. So
// nothing of a vanished db stays in NATS for longer than one sweep interval. The records of a db
// that no rule matches any more are dropped without asking CouchDB.
func (p *producer) forgetVanished(ctx context.Context, snap couch.Snapshot, done reconcile.Done) {
	seen := map[string]bool{}
	for key := range done {
		_, db, err := reconcile.ParseKey(key)
		if err != nil || seen[db] || len(seen) >= maxVanishedChecks {
			continue
		}
		if _, ok := snap[db]; ok || p.skip(db) {
			continue
		}
		seen[db] = true
		if p.rules.Groups(db) == 0 {
			// No rule matches the db any more (a rule removed or narrowed): its records serve
			// nothing, and a rule that matches it again enqueues it anyway.
			p.undone.Add(db)
			continue
		}
		if _, err := p.couch.DBInfo(ctx, db); !errors.Is(err, couch.ErrNotFound) {
			continue // there (created after the snapshot listed the dbs), or no answer: the next sweep looks again
		}
		if groups := p.mirrorGroups(db); len(groups) > 0 {
			if err := p.pub.EnqueueNoSeq(ctx, db, events.TypeDeleted, groups); err != nil {
				p.log.WithError(err).WithField("db", db).Warn("enqueue the mirror clean-up of a vanished db failed: the next sweep tries again")
				continue // its records stay, so the next sweep finds it again
			}
		}
		p.log.WithField("db", db).Info("a db with completion records is gone (its deleted event never came): its records, cached checkpoints and mirror keys are dropped")
		p.undone.Add(db)
		p.deleted.Add(db) // cached on_change checkpoints and fencing tokens
	}
}
