package producer

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/time/rate"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/publisher"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// systemDBs are CouchDB's internal dbs: their updates never produce jobs.
var systemDBs = map[string]bool{"_dbs": true, "_nodes": true, "_global_changes": true}

// IsSystemDB reports whether db is one of CouchDB's internal dbs, whose updates never produce
// jobs (nor does the spiegel db itself).
func IsSystemDB(db string) bool { return systemDBs[db] }

// feedRetry is the backoff between two attempts to open or resume the db-updates feed after
// it failed as a whole (a permanent error such as refused credentials included: they get
// fixed). The feed retries transient failures by itself.
var feedRetry = backoff.Policy{Initial: time.Second, Max: time.Minute, Multiplier: 2, Jitter: 0.2}

// producer tails the db-updates feed and publishes one job per (group, db) (SPEC §4).
type producer struct {
	cfg     producerSettings
	couch   *couch.Client
	store   *checkpoint.Store // the producer's position
	deleted *deletedDBs       // drops the cached on_change checkpoints of deleted dbs (nil: none)
	// removedRules drops what removed rules keep in the checkpoint bucket (nil: none; ruleRemoved)
	removedRules *deletedDBs
	done         *doneRecords // the completion records the sweep compares with (nil: none)
	undone       *deletedDBs  // drops the completion records of deleted dbs (nil: none)
	changes      *streamWatch // notices our changes stream losing messages (nil: not watched)
	rules        *rules.Set
	pub          *publisher.Pipeline
	hot          *publisher.HotFeeds // nil: off
	log          logrus.FieldLogger
	metrics      producerMetrics

	// askChanged replaces couch.ChangedSince in the sweep's question to CouchDB (tests; nil:
	// the client's).
	askChanged func(ctx context.Context, db, since string) (bool, error)
	// asks paces those questions (changedSince; nil: unpaced).
	asks *rate.Limiter

	feedMu     sync.Mutex // guards the fields below; never held across network I/O
	source     string
	feedErr    error             // the feed's current failure, nil while it runs
	failingAt  time.Time         // when the current failure began
	lastErr    *status.ErrorNote // the feed's last failure, for status answers (redacted)
	streamLoss *status.ErrorNote // the changes stream's last loss (streamWatch), for status answers
	permanent  bool              // feedErr is one retrying alone cannot fix (credentials, a bad request)
	resyncDue  bool              // enqueue every matched db once the feed runs (see startOver)
	savedState checkpoint.Position
	resync     chan struct{} // runResyncs enqueues every matched db on a signal
	feedUp     chan struct{} // closed the first time the feed runs (feedState(nil))
	feedUpOnce sync.Once

	saveMu     sync.Mutex // serializes saves
	savedDue   uint64     // the publisher's due count at the last save
	heldBack   bool       // the last save stopped before the safe position (SaveCandidate)
	lastSaveAt time.Time
}

// producerSettings are the parts of the configuration the producer's loop uses.
type producerSettings struct {
	SpiegelDB     string
	Source        string
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

// handle is the feed's emit function: one event in, its jobs published asynchronously. Events
// of skipped dbs move the position without making a save due: saving the position writes to
// the spiegel db, which is itself an event, so a save due on them would never let the
// producer rest (SPEC §2.4).
func (p *producer) handle(ctx context.Context, ev couch.DBEvent) error {
	p.metrics.feedEvent(ev.Type)
	if p.skip(ev.DB) {
		return p.pub.Enqueue(ctx, ev.Seq, false, ev.DB, "", nil)
	}
	if ev.Type == couch.EventDeleted {
		p.hot.Close(ev.DB, publisher.CloseDeleted)
		if p.rules.Groups(ev.DB) != 0 {
			// Cached on_change checkpoints, and the native replications' fencing tokens, which
			// share their bucket and their purge.
			p.deleted.Add(ev.DB)
			p.undone.Add(ev.DB)
		}
		return p.pub.Enqueue(ctx, ev.Seq, true, ev.DB, events.TypeDeleted, p.mirrorGroups(ev.DB))
	}
	groups := p.rules.Groups(ev.DB).Groups()
	if len(groups) == 0 {
		return p.pub.Enqueue(ctx, ev.Seq, true, ev.DB, ev.Type, nil)
	}
	if ev.Type == couch.EventUpdated {
		if h := p.hot.Cover(ev.DB); h != nil {
			p.metrics.eventCovered()
			return p.pub.Covered(ctx, ev.Seq, h)
		}
	}
	if err := p.pub.Enqueue(ctx, ev.Seq, true, ev.DB, ev.Type, groups); err != nil {
		return err
	}
	if ev.Type == couch.EventUpdated {
		p.hot.Seen(ev.DB)
	}
	return nil
}

// runFeed follows the db-updates feed from since until ctx ends. It never gives up: a failure
// of the whole feed, a permanent one included (refused credentials get fixed), is retried with
// capped backoff from the safe position, and /readyz names it meanwhile (see feedState).
func (p *producer) runFeed(ctx context.Context, since string) {
	opt := couch.FeedOptions{Heartbeat: p.cfg.Heartbeat, PollInterval: p.cfg.PollInterval, OnState: p.feedState,
		// The poll source reads the info of matched dbs only; continuous feeds get every event,
		// so the saved position keeps moving.
		Match: func(db string) bool { return !p.isPoll() || !p.skip(db) && p.rules.Groups(db) != 0 }}
	for attempt := 1; ; attempt++ {
		feed, err := p.couch.NewUpdatesFeed(ctx, p.cfg.Source, opt)
		if err == nil {
			p.setSource(feed.Source())
			since = p.checkSource(feed.Source(), since)
			log := p.log.WithFields(logrus.Fields{"source": feed.Source(), "seq": since})
			log.Info("following db updates")
			err = feed.Run(ctx, since, func(ev couch.DBEvent) error { return p.handle(ctx, ev) })
		} else {
			p.feedState(err)
		}
		if ctx.Err() != nil {
			return
		}
		if s := p.pub.Safe(); s != "" {
			since = s
		}
		if rejectedSince(err) && since != "" && since != couch.SinceNow {
			since = p.startOver("the server refused the saved position (" + err.Error() + ")")
		}
		delay := feedRetry.Delay(attempt)
		p.log.WithError(err).WithFields(logrus.Fields{"attempt": attempt, "delay": delay.String()}).
			Error("db updates feed failed: retrying")
		if backoff.Sleep(ctx, delay) != nil {
			return
		}
	}
}

// rejectedSince reports whether err is the server refusing a feed's since (400): a position
// from another server or another source.
func rejectedSince(err error) bool {
	var he *couch.HTTPError
	return errors.As(err, &he) && he.Status == http.StatusBadRequest
}

// checkSource returns where the feed of source starts: since, unless since is a position saved
// from another source, which this source cannot resume from (SPEC §4; a poll position sent to
// _db_updates is refused, and a _db_updates seq means nothing to _global_changes). Then the
// feed starts over (see startOver).
func (p *producer) checkSource(source, since string) string {
	p.feedMu.Lock()
	saved, savedSeq := p.savedState.Source, p.savedState.LastSeq
	p.feedMu.Unlock()
	if saved == "" || saved == source || since == "" || since == couch.SinceNow || since != savedSeq {
		return since
	}
	return p.startOver("the saved position is from source " + saved + ", not " + source)
}

// startOver makes the feed start from now and, once it runs, enqueue every matched db once (as
// `producer resync` does), so that nothing written before now is missed. It returns "now".
func (p *producer) startOver(why string) string {
	p.log.WithField("reason", why).Warn("starting the db updates feed from now: every matched db is enqueued once")
	p.feedMu.Lock()
	p.resyncDue = true
	p.feedMu.Unlock()
	return couch.SinceNow
}

// feedState records how the feed fares (couch.FeedOptions.OnState): one log line when it is
// interrupted and one when it is back, the feed errors metric, the failure /readyz reports,
// and the resync of startOver once the feed runs.
func (p *producer) feedState(err error) {
	p.feedMu.Lock()
	prev := p.feedErr
	p.feedErr = err
	switch {
	case err != nil && prev == nil:
		p.failingAt = time.Now()
	case err == nil:
		p.failingAt = time.Time{}
		if p.feedUp != nil {
			p.feedUpOnce.Do(func() { close(p.feedUp) })
		}
	}
	if err != nil {
		p.lastErr = &status.ErrorNote{At: time.Now().UTC(), Text: logging.RedactText("db updates feed: " + err.Error())}
	}
	p.permanent = err != nil && couch.IsPermanent(err)
	resync := err == nil && p.resyncDue
	if resync {
		p.resyncDue = false
	}
	p.feedMu.Unlock()

	switch {
	case err != nil:
		p.metrics.feedError()
		if prev == nil {
			p.log.WithError(err).Warn("db updates feed interrupted: retrying")
		}
	case prev != nil:
		p.log.Info("db updates feed restored")
	}
	if resync {
		select {
		case p.resync <- struct{}{}:
		default: // one is pending already
		}
	}
}

// runResyncs runs resyncAll each time startOver's feed is running, until ctx ends.
func (p *producer) runResyncs(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.resync:
			p.resyncAll(ctx)
		}
	}
}

// feedHealth is the readiness check of the feed: an error while the feed fails permanently, or
// has failed for longer than twice its heartbeat (a short reconnect is not a reason to be
// unready).
func (p *producer) feedHealth(context.Context) error {
	p.feedMu.Lock()
	defer p.feedMu.Unlock()
	if p.feedErr == nil || !p.permanent && time.Since(p.failingAt) < 2*p.cfg.Heartbeat {
		return nil
	}
	return p.feedErr
}

// resyncAll enqueues a job for every db a rule matches, after the feed started over from now.
func (p *producer) resyncAll(ctx context.Context) {
	n := 0
	err := p.couch.EachDB(ctx, func(db string) error {
		if p.skip(db) {
			return nil
		}
		groups := p.rules.Groups(db).Groups()
		if len(groups) == 0 {
			return nil
		}
		n++
		return p.pub.EnqueueNoSeq(ctx, db, events.ReasonResync, groups)
	})
	if err == nil {
		err = p.pub.Flush(ctx)
	}
	if err != nil {
		if ctx.Err() == nil {
			p.log.WithError(err).Error("enqueue every matched db after starting over failed: run `producer resync`")
		}
		return
	}
	p.log.WithField("dbs", n).Info("enqueued every matched db after starting over")
}

// startPosition reads the saved position, retrying while CouchDB fails, and returns where the
// feed starts and whether this is a first start: the saved position, or else the server's
// current position (SPIEGEL_START=beginning and now alike). A first start does not read the
// feed's history: the rules' catch-up, which waits for the feed to run (waitFeed), enqueues
// every db a rule matches, so nothing written before is missed. The history would only repeat
// those jobs, and a server's _db_updates history grows with every db it ever had: on a
// CouchDB 3.3 with 220,000 rows of it, a first start took 26 s before it saw a new write.
func (p *producer) startPosition(ctx context.Context) (pos checkpoint.Position, since string, first bool, err error) {
	for attempt := 1; ; attempt++ {
		pos, err = p.store.Position(ctx)
		switch {
		case err == nil:
			p.feedMu.Lock()
			p.savedState = pos
			p.feedMu.Unlock()
			return pos, pos.LastSeq, false, nil
		case errors.Is(err, checkpoint.ErrNotFound):
			return pos, couch.SinceNow, true, nil
		}
		p.log.WithError(err).WithField("attempt", attempt).Warn("read producer position, retrying")
		if err := backoff.Sleep(ctx, backoff.Default.Delay(attempt)); err != nil {
			return pos, "", false, err
		}
	}
}

// waitFeed returns once the feed runs (its position at the server is fixed: a write after it
// is an event of the feed), or ctx ends.
func (p *producer) waitFeed(ctx context.Context) error {
	select {
	case <-p.feedUp:
		return nil
	case <-ctx.Done():
		return ctx.Err()
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
	return p.source == couch.SourcePoll
}

func (p *producer) sourceUnknown() bool {
	p.feedMu.Lock()
	defer p.feedMu.Unlock()
	return p.source == ""
}

// save writes the position when it is due: the safe position moved because of events other
// than the spiegel db's, the rules seq moved, or the source changed. Idle means no write at all.
// It also updates the position age: the time since the position last moved or was confirmed
// current (nothing unsettled).
func (p *producer) save(ctx context.Context, rulesSeq string) {
	p.saveMu.Lock()
	defer p.saveMu.Unlock()
	defer func() {
		if p.metrics.m != nil && !p.lastSaveAt.IsZero() {
			p.metrics.m.FeedPositionAge.Set(time.Since(p.lastSaveAt).Seconds())
		}
	}()
	safe, due, held := p.pub.SaveCandidate()
	if safe == couch.SinceNow {
		safe = ""
	}
	p.feedMu.Lock()
	saved, source := p.savedState, p.source
	p.feedMu.Unlock()

	next := saved
	move := safe != "" && (due != p.savedDue || p.heldBack || source != saved.Source)
	if move {
		next.LastSeq, next.Source = safe, source
	}
	if rulesSeq != "" {
		next.RulesSeq = rulesSeq
	}
	if next.LastSeq == saved.LastSeq && next.RulesSeq == saved.RulesSeq && next.Source == saved.Source {
		if p.pub.Idle() && !held {
			p.lastSaveAt = time.Now()
		}
		p.heldBack = held
		return
	}
	if err := p.store.SavePosition(ctx, next); err != nil {
		p.log.WithError(err).Warn("save producer position")
		return
	}
	p.feedMu.Lock()
	p.savedState = next
	p.feedMu.Unlock()
	p.savedDue, p.heldBack = due, held
	p.lastSaveAt = time.Now()
	p.log.WithField("seq", next.LastSeq).Debug("saved producer position")
}

// runSweepIfFeed runs the reconciliation sweep once the feed's source is known, whatever it
// is: the poll source finds what _db_updates drops, but not what NATS loses.
func (p *producer) runSweepIfFeed(ctx context.Context) {
	for p.sourceUnknown() {
		if backoff.Sleep(ctx, 100*time.Millisecond) != nil {
			return
		}
	}
	p.runSweep(ctx)
}

// runSweep runs sweepOnce at once and then every SweepInterval until ctx ends: every matched db
// that a job has not processed up to its update_seq gets one, to catch what _db_updates dropped
// and what NATS lost (SPEC §3, §4.3).
func (p *producer) runSweep(ctx context.Context) {
	if p.cfg.SweepInterval <= 0 {
		return
	}
	var prev couch.Snapshot
	t := time.NewTicker(p.cfg.SweepInterval)
	defer t.Stop()
	for {
		var err error
		if prev, err = p.sweepOnce(ctx, prev); err != nil && ctx.Err() == nil {
			p.log.WithError(err).Warn("reconciliation sweep failed")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// enqueueMatching publishes jobs for every existing db that r matches (SPEC §4.6), paging
// through _all_dbs, so a new rule acts on existing data without waiting for a write. It returns
// once JetStream acknowledged every one of them (the rule feed records the rule as enqueued
// only then), or with the first error.
func (p *producer) enqueueMatching(ctx context.Context, r rules.Rule) error {
	log := p.log.WithFields(logrus.Fields{"rule": r.ID(), "group": r.Group()})
	n := 0
	err := p.couch.EachDB(ctx, func(db string) error {
		if p.skip(db) || !r.MatchesDB(db) {
			return nil
		}
		n++
		return p.pub.EnqueueNoSeq(ctx, db, events.ReasonRule, []events.Group{r.Group()})
	})
	if err == nil {
		err = p.pub.Flush(ctx)
	}
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

// mirrorGroups returns the on_change group when an on_change rule that keeps a doc-state mirror
// matches db, else nothing: a deleted db's job is needed only to delete its mirror's keys (the
// job finds the db missing and deletes them; a db recreated meanwhile rebuilds its mirror from
// its beginning instead). Without it a db deleted for good kept its docs in the mirror.
func (p *producer) mirrorGroups(db string) []events.Group {
	for _, r := range p.rules.OnChanges(db) {
		if r.Mirror != "" {
			return []events.Group{events.GroupOnChange}
		}
	}
	return nil
}
