package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// systemDBs are CouchDB's internal dbs: their updates never produce jobs.
var systemDBs = map[string]bool{"_dbs": true, "_nodes": true, "_global_changes": true}

// producer tails the db-updates feed and publishes one job per (group, db) (SPEC §4).
type producer struct {
	cfg     producerSettings
	couch   *couch.Client
	store   *checkpoint.Store
	rules   *rules.Set
	pub     *publisher
	log     logrus.FieldLogger
	metrics producerMetrics

	feedMu       sync.Mutex
	source       string
	lastSaved    string
	lastRulesSeq string
	lastSaveAt   time.Time
}

// producerSettings are the parts of the configuration the producer's loop uses.
type producerSettings struct {
	SpiegelDB     string
	Source        string
	Start         string
	Heartbeat     time.Duration
	PollInterval  time.Duration
	SweepInterval time.Duration
	SaveInterval  time.Duration
	Grace         time.Duration
}

// skip reports whether db's updates never produce jobs: the spiegel db and CouchDB's own dbs.
func (p *producer) skip(db string) bool {
	return db == p.cfg.SpiegelDB || systemDBs[db]
}

// handle is the feed's emit function: one event in, its jobs published asynchronously.
func (p *producer) handle(ctx context.Context, ev couch.DBEvent) error {
	p.metrics.feedEvent(ev.Type)
	if p.skip(ev.DB) {
		return p.pub.Enqueue(ctx, ev.Seq, true, ev.DB, "", nil)
	}
	if ev.Type == events.TypeDeleted {
		p.removeCheckpoints(ctx, ev.DB)
		return p.pub.Enqueue(ctx, ev.Seq, true, ev.DB, events.TypeDeleted, nil)
	}
	groups := p.rules.Groups(ev.DB).Groups()
	return p.pub.Enqueue(ctx, ev.Seq, true, ev.DB, ev.Type, groups)
}

// removeCheckpoints deletes the on_change checkpoints of a deleted db, so a recreated db is
// processed from its beginning. A failure is logged; the consumer also notices a recreated db by
// its instance start time.
func (p *producer) removeCheckpoints(ctx context.Context, db string) {
	var ids []string
	for _, r := range p.rules.All() {
		if r.Kind() == rules.KindOnChange {
			ids = append(ids, r.ID())
		}
	}
	if len(ids) == 0 {
		return
	}
	if err := p.store.DeleteDB(ctx, db, ids); err != nil {
		p.log.WithField("db", db).WithError(err).Warn("remove checkpoints of deleted db")
	}
}

// runFeed follows the db-updates feed from the saved position forever, restarting it after any
// error that is not the context's.
func (p *producer) runFeed(ctx context.Context, since string) error {
	feed, err := p.newFeed(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	p.setSource(feed.Source())
	log := p.log.WithField("source", feed.Source())
	log.WithField("seq", since).Info("following db updates")
	for attempt := 1; ; attempt++ {
		err := feed.Run(ctx, since, func(ev couch.DBEvent) error { return p.handle(ctx, ev) })
		if ctx.Err() != nil {
			return nil
		}
		p.metrics.feedError()
		log.WithError(err).WithField("attempt", attempt).Error("db updates feed stopped, restarting")
		if backoff.Sleep(ctx, backoff.Default.Delay(attempt)) != nil {
			return nil
		}
		if s := p.pub.Safe(); s != "" {
			since = s
		}
	}
}

// newFeed picks the source, retrying while CouchDB is unreachable.
func (p *producer) newFeed(ctx context.Context) (couch.UpdatesFeed, error) {
	opt := couch.FeedOptions{Heartbeat: p.cfg.Heartbeat, PollInterval: p.cfg.PollInterval,
		// The poll source reads the info of matched dbs only; continuous feeds get every event,
		// so the saved position keeps moving.
		Match: func(db string) bool { return !p.isPoll() || !p.skip(db) && p.rules.Groups(db) != 0 }}
	for attempt := 1; ; attempt++ {
		feed, err := p.couch.NewUpdatesFeed(ctx, p.cfg.Source, opt)
		if err == nil {
			return feed, nil
		}
		if errors.Is(err, couch.ErrPermanent) {
			return nil, fmt.Errorf("open db updates feed: %w", err)
		}
		p.metrics.feedError()
		p.log.WithError(err).WithField("attempt", attempt).Warn("CouchDB not reachable, retrying")
		if err := backoff.Sleep(ctx, backoff.Default.Delay(attempt)); err != nil {
			return nil, err
		}
	}
}

// startPosition returns where the feed starts: the saved position, or per Start on first run.
func (p *producer) startPosition(ctx context.Context) (string, error) {
	for attempt := 1; ; attempt++ {
		pos, err := p.store.Position(ctx)
		switch {
		case err == nil:
			p.lastSaved = pos.LastSeq
			p.lastRulesSeq = pos.RulesSeq
			return pos.LastSeq, nil
		case errors.Is(err, checkpoint.ErrNotFound):
			if p.cfg.Start == "now" {
				return "now", nil
			}
			return "", nil
		}
		p.log.WithError(err).WithField("attempt", attempt).Warn("read producer position, retrying")
		if err := backoff.Sleep(ctx, backoff.Default.Delay(attempt)); err != nil {
			return "", err
		}
	}
}

// runSaver saves the safe position every SaveInterval; the caller saves once more at the end.
func (p *producer) runSaver(ctx context.Context, rulesSeq func() string) {
	t := time.NewTicker(p.cfg.SaveInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.save(ctx, rulesSeq())
		}
	}
}

func (p *producer) setSource(s string) {
	p.feedMu.Lock()
	p.source = s
	p.feedMu.Unlock()
}

func (p *producer) isPoll() bool {
	p.feedMu.Lock()
	defer p.feedMu.Unlock()
	return p.source == "poll"
}

// save writes the safe position (and the rules seq) if either moved, and updates the position
// age: the time since the position last moved or was confirmed current (nothing unsettled).
func (p *producer) save(ctx context.Context, rulesSeq string) {
	p.feedMu.Lock()
	defer p.feedMu.Unlock()
	defer func() {
		if p.metrics.m != nil && !p.lastSaveAt.IsZero() {
			p.metrics.m.FeedPositionAge.Set(time.Since(p.lastSaveAt).Seconds())
		}
	}()
	source := p.source
	safe := p.pub.Safe()
	if safe == "now" {
		safe = ""
	}
	if safe == "" && rulesSeq == "" || safe == p.lastSaved && rulesSeq == p.lastRulesSeq {
		if p.pub.Idle() {
			p.lastSaveAt = time.Now()
		}
		return
	}
	if safe == "" {
		safe = p.lastSaved
	}
	if err := p.store.SavePosition(ctx, checkpoint.Position{LastSeq: safe, RulesSeq: rulesSeq, Source: source}); err != nil {
		p.log.WithError(err).Warn("save producer position")
		return
	}
	p.lastSaved = safe
	p.lastRulesSeq = rulesSeq
	p.lastSaveAt = time.Now()
	p.log.WithField("seq", safe).Debug("saved producer position")
}

// runSweepIfFeed runs the reconciliation sweep unless the feed is the poll source, which is a
// sweep already.
func (p *producer) runSweepIfFeed(ctx context.Context) {
	for p.sourceUnknown() {
		if backoff.Sleep(ctx, 100*time.Millisecond) != nil {
			return
		}
	}
	if p.isPoll() {
		return
	}
	p.runSweep(ctx)
}

func (p *producer) sourceUnknown() bool {
	p.feedMu.Lock()
	defer p.feedMu.Unlock()
	return p.source == ""
}

// runSweep enqueues every matched db whose update_seq changed since the previous sweep, to
// catch what _db_updates dropped (SPEC §4.3). The first sweep only takes the baseline.
func (p *producer) runSweep(ctx context.Context) {
	if p.cfg.SweepInterval <= 0 {
		return
	}
	var prev couch.Snapshot
	t := time.NewTicker(p.cfg.SweepInterval)
	defer t.Stop()
	for {
		snap, err := p.couch.TakeSnapshot(ctx, func(db string) bool {
			return !p.skip(db) && p.rules.Groups(db) != 0
		})
		if err != nil && ctx.Err() == nil {
			p.log.WithError(err).Warn("reconciliation sweep failed")
		}
		if err == nil {
			if prev != nil {
				for _, ev := range couch.Diff(prev, snap) {
					if ev.Type == events.TypeDeleted {
						continue
					}
					p.metrics.sweepEnqueued()
					if err := p.pub.Enqueue(ctx, "", false, ev.DB, events.ReasonSweep, p.rules.Groups(ev.DB).Groups()); err != nil {
						return
					}
				}
			}
			prev = snap
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// enqueueMatching publishes jobs for every existing db that r matches (SPEC §4.6), paging
// through _all_dbs, so a new rule acts on existing data without waiting for a write.
func (p *producer) enqueueMatching(ctx context.Context, r rules.Rule) error {
	log := p.log.WithFields(logrus.Fields{"rule": r.ID(), "group": r.Group()})
	n := 0
	err := p.couch.EachDB(ctx, func(db string) error {
		if p.skip(db) || !r.MatchesDB(db) {
			return nil
		}
		n++
		return p.pub.Enqueue(ctx, "", false, db, events.ReasonRule, []events.Group{r.Group()})
	})
	if err != nil {
		if ctx.Err() == nil {
			log.WithError(err).Warn("enqueue dbs of new rule")
		}
		return err
	}
	if n > 0 {
		log.WithField("dbs", n).Info("enqueued existing dbs for new rule")
	}
	return nil
}
