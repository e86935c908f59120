package publisher

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// HotFeeds keeps continuous _changes feeds open on busy dbs and publishes a db's jobs the moment
// a change arrives on its feed, instead of the ~0.3–0.5 s later the db-updates feed reports it
// (CouchDB batches _db_updates: [global_changes] max_write_delay).
//
// A feed must earn its connection. It costs one connection to CouchDB and a listener there that
// holds the db's shards open, so a db gets one only when its writes show it busy: hotEvents
// db-updates events of the db in a row, each within idle of the one before (Seen), and fewer
// than max feeds are open. At the limit no feed is closed to make room — among equally busy dbs
// that would only make feeds churn, each churn a request — the busy db stays on the db-updates
// path. A feed closes once it has delivered no change for idle, the same span that earned it: it
// no longer pays. A db written once, or now and then, never opens one.
//
// A producer catching up on a backlog reads old events in a burst, so a db busy in the past may
// earn a feed then: at most max of them, each closed after idle without costing more than its
// open (nothing was passed over).
//
// Once a feed has delivered a change and that change's jobs are settled, the feed "covers" its
// db: every later db-updates event of the db is redundant and is passed over (Cover,
// Pipeline.Covered), which keeps a hot db at one run per change. The saved position stays
// before each passed-over event until a job that stands for the event's change is settled —
// acknowledged by JetStream (Hold), never by a clock:
//   - a job of the db published after the event was read stands for it: the change was made
//     before the event, the job reads the db after; the feed's next publish releases the hold;
//   - when the feed closes with holds left, one _changes request after the last seq it delivered
//     says whether it delivered every change made so far; if so, and the publish after its last
//     change is settled, that publish stands for the events; otherwise the db's jobs are
//     published once more, and the holds released when they are settled;
//   - a producer that stops (or dies) first leaves the saved position before the events: the
//     next one reads them again. A deleted db, or one no rule matches any more, wants no job.
type HotFeeds struct {
	couch     DBChanges
	pub       *Pipeline
	groups    func(db string) []events.Group
	log       logrus.FieldLogger
	metrics   producerMetrics
	max       int
	idle      time.Duration
	heartbeat time.Duration
	// retryAfter keeps a db whose feed failed to open or broke from being opened again for a
	// while (a db without read access, a server refusing): its events take the db-updates path.
	retryAfter time.Duration

	now func() time.Time // time.Now; tests move it

	mu    sync.Mutex
	ctx   context.Context // Run's; feeds end with it
	feeds map[string]*hotFeed
	// events is how many db-updates events in a row, each within idle of the one before, earn a
	// db its feed: hotEvents, more while the feeds that closed lately did not pay (judge)
	events int
	recent map[string]streak    // db → its latest events, while it has no feed
	failed map[string]time.Time // db → when it may be opened again
	wg     sync.WaitGroup
}

// hotEvents is how many db-updates events of a db in a row, each within SPIEGEL_HOT_FEED_IDLE of
// the one before, earn it a feed at least. On bench-e2e's workload (10 % of N dbs written, 10
// docs/s; BenchmarkHotFeedsEarned, 20 s) two open a feed for one write in 8 at N = 10,000, all 32
// open, each serving a ninth of a write; three open one for one write in 75, 9 at most open, and
// still give each busy db of N = 200 its feed (94 % of writes on the fast path); with the bar
// rising while feeds do not pay, one for one write in 600 at N = 10,000, 2 at most open.
//
// A feed pays when it delivers at least payingChanges changes before it closes idle: more
// changes on the fast path than requests spent on it (its open, and at most one check when it
// closes). Each feed that closes idle without paying raises the streak a db needs by one, up to
// maxHotEvents; each that paid lowers it by one, down to hotEvents (judge). Where writes are
// spread thin over many dbs (N = 10,000: a db written every 100 s on average), a streak of three
// comes by chance, the feeds it opens deliver nothing, and the bar rises until chance no longer
// reaches it; where a few dbs are busy, their feeds stay open and pay, and the bar stays low.
const (
	hotEvents     = 3
	maxHotEvents  = 8
	payingChanges = 2
)

// streak is a db's latest db-updates events, each within idle of the one before.
type streak struct {
	last time.Time
	n    int
}

// DBChanges is what hot feeds read of CouchDB (*couch.Client).
type DBChanges interface {
	WatchChanges(ctx context.Context, db string, opt couch.ChangesOptions, connected func(), emit func(couch.Change) error) error
	Changes(ctx context.Context, db string, opt couch.ChangesOptions) (couch.ChangesPage, error)
}

// hotFeed is one db's open feed. Its fields are guarded by HotFeeds.mu.
type hotFeed struct {
	db     string
	cancel context.CancelFunc
	// why the feed is being closed ("" while it runs): decides the jobs published when it ends
	closing string
	covers  bool      // a change's jobs are settled: db-updates events of db are redundant
	changed time.Time // the last change delivered (or the open)
	// delivered counts the changes the feed delivered, lastSeq is the last one's seq; settled
	// is the count delivered when the newest settled publish began: every change up to it has
	// a settled job published after it.
	delivered, settled uint64
	lastSeq            string
	// holds of the db-updates events passed over since the last publish began
	holds []*Hold
	// kick asks publishLoop for the db's jobs; a burst of changes while one publish is in
	// flight is one more publish, not one each
	kick chan struct{}
}

// Reasons a hot feed is closed (the reason label of spiegel_hot_feeds_closed_total).
const (
	CloseIdle    = "idle"
	CloseDeleted = "db_deleted"
	CloseNoRule  = "no_rule"
	CloseStopped = "stopping"
	CloseFailed  = "failed"
)

// What closing a feed cost (the then label of spiegel_hot_feeds_closed_total).
const (
	CloseThenNone      = "none"      // nothing passed over since the last publish, or no job wanted (db deleted, no rule)
	CloseThenChecked   = "checked"   // one _changes request: the feed had delivered everything
	CloseThenPublished = "published" // the db's jobs were published once more
	CloseThenHeld      = "held"      // stopping: the saved position stays before the events
)

// NewHotFeeds returns hot feeds on the dbs of c that publish through pub the jobs of the groups
// whose rules match a db (groups), at most max feeds open, each closed once idle for idle; m
// (nil: none) counts them. Run runs them.
func NewHotFeeds(c DBChanges, pub *Pipeline, groups func(string) []events.Group, max int, idle, heartbeat time.Duration,
	m *metrics.Producer, log logrus.FieldLogger) *HotFeeds {
	h := &HotFeeds{couch: c, pub: pub, groups: groups, max: max, idle: idle, heartbeat: heartbeat, retryAfter: time.Minute,
		metrics: producerMetrics{m: m}, log: log, now: time.Now, feeds: map[string]*hotFeed{}, events: hotEvents, recent: map[string]streak{}, failed: map[string]time.Time{}}
	if max > 0 {
		h.metrics.hotFeedStreak(h.events)
	}
	return h
}

// Run closes idle feeds until ctx ends, then closes every feed and waits for them.
func (h *HotFeeds) Run(ctx context.Context) {
	h.mu.Lock()
	h.ctx = ctx
	h.mu.Unlock()
	t := time.NewTicker(max(h.idle/4, 10*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			h.mu.Lock()
			for _, f := range h.feeds {
				h.closeLocked(f, CloseStopped)
			}
			h.mu.Unlock()
			h.wg.Wait()
			return
		case <-t.C:
			h.tidy()
		}
	}
}

// tidy closes the feeds idle for h.idle and forgets what is older than that, memory included.
func (h *HotFeeds) tidy() {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now()
	for _, f := range h.feeds {
		if now.Sub(f.changed) >= h.idle {
			h.closeLocked(f, CloseIdle)
		}
	}
	for db, st := range h.recent {
		if now.Sub(st.last) > h.idle {
			delete(h.recent, db)
		}
	}
	for db, until := range h.failed {
		if now.After(until) {
			delete(h.failed, db)
		}
	}
	// A map keeps the room of its biggest size: fresh ones give back what a burst of dbs
	// written once (a first sync of 100,000 dbs: 7 MiB) took.
	if len(h.recent) == 0 {
		h.recent = map[string]streak{}
	}
	if len(h.failed) == 0 {
		h.failed = map[string]time.Time{}
	}
}

// Count returns the number of feeds open.
func (h *HotFeeds) Count() int {
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.feeds)
}

// Cover returns a hold when a db-updates event of db is redundant because db's feed covers it;
// the caller then passes over the event with the hold (Pipeline.Covered). It returns nil when
// the event must take the db-updates path.
func (h *HotFeeds) Cover(db string) *Hold {
	if h == nil {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f, ok := h.feeds[db]
	if !ok || !f.covers || f.closing != "" {
		return nil
	}
	hd := &Hold{}
	f.holds = append(f.holds, hd)
	return hd
}

// Seen notes a db-updates event of db, which rules match, whose jobs were enqueued; it opens a
// feed on db when the event is the db's h.events-th in a row each within h.idle of the one
// before, unless one is open, max are open, the db's feed failed lately, or Run is not running.
func (h *HotFeeds) Seen(db string) {
	if h == nil || h.max <= 0 {
		return
	}
	now := h.now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ctx == nil || h.ctx.Err() != nil {
		return
	}
	if _, ok := h.feeds[db]; ok {
		return
	}
	st, ok := h.recent[db]
	if !ok || now.Sub(st.last) > h.idle {
		st.n = 0
	}
	st.n++
	st.last = now
	h.recent[db] = st
	if st.n < h.events {
		return
	}
	if until, ok := h.failed[db]; ok && now.Before(until) {
		return
	}
	if len(h.feeds) >= h.max {
		h.metrics.hotFeedRefused()
		return
	}
	delete(h.recent, db)
	delete(h.failed, db)
	ctx, cancel := context.WithCancel(h.ctx)
	f := &hotFeed{db: db, cancel: cancel, changed: now, kick: make(chan struct{}, 1)}
	h.feeds[db] = f
	h.metrics.feedsOpen(len(h.feeds))
	h.metrics.hotFeedOpened()
	h.log.WithFields(logrus.Fields{"db": db, "events": st.n, "feeds": len(h.feeds)}).Debug("hot feed opened")
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		h.follow(ctx, f)
	}()
}

// Close closes db's feed, if any, because of why (CloseDeleted, CloseNoRule), and forgets db.
func (h *HotFeeds) Close(db, why string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.recent, db)
	if f, ok := h.feeds[db]; ok {
		h.closeLocked(f, why)
	}
}

// closeLocked stops f from covering its db at once and ends its connection; the feed's
// goroutine finishes the close (follow).
func (h *HotFeeds) closeLocked(f *hotFeed, why string) {
	if f.closing != "" {
		return
	}
	f.closing = why
	f.covers = false
	delete(h.feeds, f.db)
	if why == CloseIdle {
		h.judge(f)
	}
	h.metrics.feedsOpen(len(h.feeds))
	f.cancel()
}

// judge moves the streak a db needs to earn a feed by whether f, closing idle, paid (see
// payingChanges). Feeds closed for other reasons (the db deleted, a failure, the producer
// stopping) say nothing about the workload.
func (h *HotFeeds) judge(f *hotFeed) {
	if f.delivered >= payingChanges {
		h.events = max(h.events-1, hotEvents)
	} else {
		h.events = min(h.events+1, maxHotEvents)
	}
	h.metrics.hotFeedStreak(h.events)
}

// follow runs f's connection until it ends, then settles the holds of the events it passed
// over (see HotFeeds).
func (h *HotFeeds) follow(ctx context.Context, f *hotFeed) {
	log := h.log.WithField("db", f.db)
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); h.publishLoop(ctx, f) }()
	err := h.couch.WatchChanges(ctx, f.db, couch.ChangesOptions{Heartbeat: h.heartbeat}, nil, func(c couch.Change) error {
		h.changed(f, c.Seq)
		return nil
	})
	h.mu.Lock()
	switch {
	case f.closing != "":
	case h.ctx.Err() != nil: // Run is ending (and ended the feed)
		h.closeLocked(f, CloseStopped)
	default: // the connection ended by itself
		h.closeLocked(f, CloseFailed)
		h.failed[f.db] = h.now().Add(h.retryAfter)
	}
	h.mu.Unlock()
	<-pubDone // publishLoop hands back the holds of a publish it could not make
	h.mu.Lock()
	why, holds := f.closing, f.holds
	f.holds = nil
	h.mu.Unlock()
	if why == CloseFailed && !errors.Is(err, couch.ErrNotFound) {
		log.WithError(err).Info("hot feed ended: the db's events take the db-updates path again")
	}
	then := h.settleHolds(f, why, holds)
	h.metrics.hotFeedClosed(why, then)
	h.mu.Lock()
	delivered := f.delivered
	h.mu.Unlock()
	log.WithFields(logrus.Fields{"reason": why, "then": then, "changes": delivered}).Debug("hot feed closed")
}

// settleHolds releases, or leaves, the holds of a closed feed and says what it cost.
func (h *HotFeeds) settleHolds(f *hotFeed, why string, holds []*Hold) string {
	if len(holds) == 0 {
		return CloseThenNone
	}
	switch why {
	case CloseStopped:
		return CloseThenHeld
	case CloseDeleted, CloseNoRule:
		h.pub.Release(holds)
		return CloseThenNone
	}
	ctx := h.runCtx()
	h.mu.Lock()
	upToDate, since := f.settled == f.delivered, f.lastSeq
	h.mu.Unlock()
	if upToDate && since != "" {
		// Every change up to since has a settled job published after it. If nothing came after
		// since, the changes of the passed-over events (made before they were read, so before
		// this request) are among them.
		page, err := h.couch.Changes(ctx, f.db, couch.ChangesOptions{Since: since, Limit: 1})
		if err == nil && len(page.Results) == 0 {
			h.pub.Release(holds)
			return CloseThenChecked
		}
		if errors.Is(err, couch.ErrNotFound) {
			// The db is gone: its deletion event releases nothing, so release here.
			h.pub.Release(holds)
			return CloseThenNone
		}
	}
	groups := h.groups(f.db)
	if len(groups) == 0 {
		h.pub.Release(holds)
		return CloseThenNone
	}
	if err := h.pub.EnqueueThen(ctx, f.db, events.TypeUpdated, groups, func() { h.pub.Release(holds) }); err != nil {
		return CloseThenHeld // stopping: the saved position stays before the events
	}
	return CloseThenPublished
}

func (h *HotFeeds) runCtx() context.Context {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ctx
}

// changed notes a change f delivered and asks for its db's jobs. A change that comes while they
// are being published makes them published once more after; more changes meanwhile add nothing.
func (h *HotFeeds) changed(f *hotFeed, seq string) {
	h.mu.Lock()
	f.delivered++
	f.lastSeq = seq
	if f.closing == "" {
		f.changed = h.now()
	}
	h.mu.Unlock()
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// publishLoop publishes the jobs of f's db for each kick until ctx ends; once a publish is
// settled, the feed covers its db, and the holds of the events passed over before it began are
// released.
func (h *HotFeeds) publishLoop(ctx context.Context, f *hotFeed) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.kick:
		}
		groups := h.groups(f.db)
		if len(groups) == 0 {
			h.Close(f.db, CloseNoRule)
			return
		}
		h.mu.Lock()
		upTo, holds := f.delivered, f.holds
		f.holds = nil
		h.mu.Unlock()
		h.metrics.hotFeedJob()
		settled := make(chan struct{})
		err := h.pub.EnqueueThen(ctx, f.db, events.TypeUpdated, groups, func() {
			h.mu.Lock()
			f.settled = max(f.settled, upTo)
			if f.closing == "" {
				f.covers = true
			}
			h.mu.Unlock()
			h.pub.Release(holds)
			close(settled)
		})
		if err != nil {
			h.mu.Lock()
			f.holds = append(holds, f.holds...)
			h.mu.Unlock()
			return
		}
		select {
		case <-settled:
		case <-ctx.Done():
			return
		}
	}
}
