package main

import (
	"container/list"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
)

// hotFeeds keeps continuous _changes feeds open on the dbs that changed last (at most max, the
// least recently changed closed first, each closed after idle without a change) and publishes a
// db's jobs the moment a change arrives on its feed, instead of the ~0.3–0.5 s later the
// db-updates feed reports it (CouchDB batches _db_updates: [global_changes] max_write_delay).
//
// Once a feed has delivered a change and that change's jobs are settled, the feed "covers" its
// db: every later db-updates event of the db is redundant and is passed over (publisher.Covered),
// which keeps a hot db at one run per change. Why that loses nothing:
//   - a change made before the feed was open is read by the first job the feed published, which
//     was offered after the feed was open;
//   - a change made after it is delivered by the feed, which publishes its jobs;
//   - when a feed ends after passing over an event, it publishes the db's jobs once more — unless
//     it is closed as idle, having stayed up (not torn down as stalled) for longer after its
//     last change than a stalled feed lasts, so it delivered every change there was;
//   - should the process die, the saved position stays before every passed-over event for
//     holdFor (publisher.SaveCandidate), longer than a feed takes to deliver a change or be torn
//     down as stalled (twice its heartbeat): the next producer reads those events again.
type hotFeeds struct {
	couch     *couch.Client
	pub       *publisher
	groups    func(db string) []events.Group
	log       logrus.FieldLogger
	metrics   producerMetrics
	max       int
	idle      time.Duration
	heartbeat time.Duration
	// retryAfter keeps a db whose feed failed to open or broke from being opened again for a
	// while (a db without read access, a server refusing): its events take the db-updates path.
	retryAfter time.Duration

	mu     sync.Mutex
	ctx    context.Context // Run's; feeds end with it
	feeds  map[string]*hotFeed
	order  *list.List           // of *hotFeed, most recently changed first
	failed map[string]time.Time // db → when it may be opened again
	wg     sync.WaitGroup
}

// hotFeed is one db's open feed. Its fields are guarded by hotFeeds.mu.
type hotFeed struct {
	db     string
	cancel context.CancelFunc
	elem   *list.Element
	// why the feed is being closed ("" while it runs): decides the jobs published when it ends
	closing string
	covers  bool      // a change's jobs are settled: db-updates events of db are redundant
	changed time.Time // the last change delivered (or the open)
	// kick asks publishLoop for the db's jobs; a burst of changes while one publish is in
	// flight is one more publish, not one each
	kick chan struct{}
	// passedOver: a db-updates event of the db was passed over (see follow)
	passedOver bool
}

// Reasons a hot feed is closed.
const (
	closeIdle    = "idle"
	closeEvicted = "evicted"
	closeDeleted = "db deleted"
	closeNoRule  = "no rule matches"
	closeStopped = "stopping"
	closeFailed  = "feed failed"
)

func newHotFeeds(c *couch.Client, pub *publisher, groups func(string) []events.Group, max int, idle, heartbeat time.Duration,
	m producerMetrics, log logrus.FieldLogger) *hotFeeds {
	return &hotFeeds{couch: c, pub: pub, groups: groups, max: max, idle: idle, heartbeat: heartbeat, retryAfter: time.Minute,
		metrics: m, log: log, feeds: map[string]*hotFeed{}, order: list.New(), failed: map[string]time.Time{}}
}

// holdFor is how long the saved position stays before an event a hot feed covered: beyond the
// time a stalled feed takes to be torn down (twice the heartbeat), with room to spare.
func holdFor(heartbeat time.Duration) time.Duration {
	return max(30*time.Second, 3*heartbeat)
}

// Run closes idle feeds until ctx ends, then closes every feed and waits for them.
func (h *hotFeeds) Run(ctx context.Context) {
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
				h.closeLocked(f, closeStopped)
			}
			h.mu.Unlock()
			h.wg.Wait()
			return
		case <-t.C:
			h.closeIdle()
		}
	}
}

func (h *hotFeeds) closeIdle() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for e := h.order.Back(); e != nil; {
		f := e.Value.(*hotFeed)
		e = e.Prev()
		if time.Since(f.changed) < h.idle {
			return
		}
		h.closeLocked(f, closeIdle)
	}
}

// Covers reports whether a db-updates event of db is redundant because db's feed covers it; the
// caller then passes over the event (publisher.Covered).
func (h *hotFeeds) Covers(db string) bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f, ok := h.feeds[db]
	if !ok || !f.covers || f.closing != "" {
		return false
	}
	f.passedOver = true
	return true
}

// Open opens a feed on db, which just changed and which rules match, unless one is open, the
// db's feed failed lately, or Run is not running. At the limit, the least recently changed feed
// is closed first.
func (h *hotFeeds) Open(db string) {
	if h == nil || h.max <= 0 {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ctx == nil || h.ctx.Err() != nil {
		return
	}
	if _, ok := h.feeds[db]; ok {
		return
	}
	if until, ok := h.failed[db]; ok {
		if time.Now().Before(until) {
			return
		}
		delete(h.failed, db)
	}
	for h.order.Len() >= h.max {
		h.closeLocked(h.order.Back().Value.(*hotFeed), closeEvicted)
	}
	ctx, cancel := context.WithCancel(h.ctx)
	f := &hotFeed{db: db, cancel: cancel, changed: time.Now(), kick: make(chan struct{}, 1)}
	f.elem = h.order.PushFront(f)
	h.feeds[db] = f
	h.metrics.hotFeeds(len(h.feeds))
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		h.follow(ctx, f)
	}()
}

// Close closes db's feed, if any, because of why (closeDeleted, closeNoRule).
func (h *hotFeeds) Close(db, why string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if f, ok := h.feeds[db]; ok {
		h.closeLocked(f, why)
	}
}

// closeLocked stops f from covering its db at once and ends its connection; the feed's
// goroutine finishes the close (ended).
func (h *hotFeeds) closeLocked(f *hotFeed, why string) {
	if f.closing != "" {
		return
	}
	f.closing = why
	f.covers = false
	h.order.Remove(f.elem)
	delete(h.feeds, f.db)
	h.metrics.hotFeeds(len(h.feeds))
	f.cancel()
}

// follow runs f's connection until it ends, then publishes the db's jobs once more if an event
// was passed over that the feed may not have delivered.
func (h *hotFeeds) follow(ctx context.Context, f *hotFeed) {
	log := h.log.WithField("db", f.db)
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); h.publishLoop(ctx, f) }()
	err := h.couch.WatchChanges(ctx, f.db, couch.ChangesOptions{Heartbeat: h.heartbeat}, nil, func(couch.Change) error {
		h.changed(f)
		return nil
	})
	h.mu.Lock()
	if f.closing == "" { // the connection ended by itself
		h.closeLocked(f, closeFailed)
		h.failed[f.db] = time.Now().Add(h.retryAfter)
		h.pruneFailedLocked()
	}
	why, passedOver := f.closing, f.passedOver
	h.mu.Unlock()
	<-pubDone
	if why == closeFailed && !errors.Is(err, couch.ErrNotFound) {
		log.WithError(err).Info("hot feed ended: the db's events take the db-updates path again")
	} else {
		log.WithField("reason", why).Debug("hot feed closed")
	}
	// A feed closed as idle stayed up (it was not torn down as stalled) for longer than a stalled
	// one lasts after its last change: it delivered the change of every event it passed over.
	// A feed that ended otherwise may not have.
	again := passedOver && (why != closeIdle || h.idle <= 2*h.heartbeat)
	if why == closeStopped || why == closeDeleted || why == closeNoRule || !again {
		// Stopping: the saved position holds the passed-over events. Deleted or unmatched: no
		// job is wanted.
		return
	}
	if groups := h.groups(f.db); len(groups) > 0 {
		if err := h.pub.EnqueueThen(h.runCtx(), f.db, events.TypeUpdated, groups, nil); err != nil && h.runCtx().Err() == nil {
			log.WithError(err).Error("publish the jobs of a closed hot feed")
		}
	}
}

func (h *hotFeeds) runCtx() context.Context {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ctx
}

// changed notes a change f delivered and asks for its db's jobs. A change that comes while they
// are being published makes them published once more after; more changes meanwhile add nothing.
func (h *hotFeeds) changed(f *hotFeed) {
	h.mu.Lock()
	if f.closing == "" {
		f.changed = time.Now()
		h.order.MoveToFront(f.elem)
	}
	h.mu.Unlock()
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// publishLoop publishes the jobs of f's db for each kick until ctx ends; once a publish is
// settled, the feed covers its db.
func (h *hotFeeds) publishLoop(ctx context.Context, f *hotFeed) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.kick:
		}
		groups := h.groups(f.db)
		if len(groups) == 0 {
			h.Close(f.db, closeNoRule)
			return
		}
		h.metrics.hotFeedJob()
		settled := make(chan struct{})
		if err := h.pub.EnqueueThen(ctx, f.db, events.TypeUpdated, groups, func() { close(settled) }); err != nil {
			return
		}
		select {
		case <-settled:
			h.mu.Lock()
			if f.closing == "" {
				f.covers = true
			}
			h.mu.Unlock()
		case <-ctx.Done():
			return
		}
	}
}

// pruneFailedLocked forgets failures whose wait is over, so the map stays small.
func (h *hotFeeds) pruneFailedLocked() {
	now := time.Now()
	for db, until := range h.failed {
		if now.After(until) {
			delete(h.failed, db)
		}
	}
}
