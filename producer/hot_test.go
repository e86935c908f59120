package main

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
	"github.com/spiegel-nats/spiegel/pkg/publisher"
)

// Hot feeds against a real CouchDB: the proxy serves its own _db_updates feed
// (couchtest.AlwaysSynthesize) on both servers, so that a test can hold it back and see what the
// hot feeds do alone. The tests read what happened from the producer's metrics, not its logs.
// pkg/publisher/hotfeeds_test.go drives the same logic with a fake feed, in an order the test
// decides.

// newHotEnv is an env whose in-process producers keep up to feeds hot feeds (idle: 1 min) and
// serve their metrics on e.cfg.HTTPAddr.
func newHotEnv(t *testing.T, feeds int) *env {
	t.Helper()
	e := newEnv(t, couchtest.AlwaysSynthesize())
	e.cfg.HotFeeds, e.cfg.HotFeedIdle = feeds, time.Minute
	e.cfg.HTTPAddr = healthtest.FreeAddr(t)
	return e
}

// metric returns the value of a producer metric served on addr (0 for a counter never counted).
func metric(t *testing.T, addr, name string, labelPairs ...string) float64 {
	t.Helper()
	return healthtest.Scrape(t, addr).Get(name, labelPairs...)
}

// covered returns how many db-updates events the producer on addr passed over.
func covered(t *testing.T, addr string) float64 {
	return metric(t, addr, "spiegel_feed_events_covered_total")
}

// writeUntil writes a new doc to db every 200 ms until cond holds, for up to within.
func (e *env) writeUntil(t *testing.T, db string, within time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for i := 0; !cond(); i++ {
		require.True(t, time.Now().Before(deadline), "no %s within %s", what, within)
		e.Couch.Put(t, db, fmt.Sprintf("w%d", time.Now().UnixNano()), map[string]any{"i": i})
		deadline := time.Now().Add(200 * time.Millisecond)
		for !cond() && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// quiet purges the jobs of (g, db) until none comes for 300 ms: publishes of the hot feed still
// in flight have landed.
func (e *env) quiet(t *testing.T, g events.Group, db string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for calm := time.Now(); time.Since(calm) < 300*time.Millisecond; time.Sleep(20 * time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "jobs of %s for %s kept coming", g, db)
		if e.Pending(t)[work(g, db)] > 0 {
			e.Purge(t)
			calm = time.Now()
		}
	}
}

// noJobFor checks for d that no job of (g, db) is pending.
func (e *env) noJobFor(t *testing.T, g events.Group, db string, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		require.Zero(t, e.Pending(t)[work(g, db)], "a job of %s for %s", g, db)
	}
}

// openHotFeed writes to db until its hot feed is open: a db earns one when its db-updates
// events come close together.
func (e *env) openHotFeed(t *testing.T, db string) {
	t.Helper()
	opened := metric(t, e.cfg.HTTPAddr, "spiegel_hot_feeds_opened_total")
	e.writeUntil(t, db, 20*time.Second, func() bool {
		return metric(t, e.cfg.HTTPAddr, "spiegel_hot_feeds_opened_total") > opened
	}, "hot feed of "+db)
}

// A change of a db with a hot feed gets its job while the db-updates feed says nothing; its
// late db-updates event, once it comes, is passed over instead of publishing a job again.
func TestHotFeedPublishesBeforeDBUpdates(t *testing.T) {
	e := newHotEnv(t, 10)
	db := e.Prefix + "hot"
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second) // the rule's own enqueue
	e.waitRulesCaughtUp(t)
	e.openHotFeed(t, db)
	e.quiet(t, rep, db)

	e.updates.Hold()
	events := e.updates.Events()
	publishes := metric(t, e.cfg.HTTPAddr, "spiegel_hot_feed_publishes_total")
	e.writeUntil(t, db, 20*time.Second, func() bool { return e.Pending(t)[work(rep, db)] == 1 }, "job from the hot feed")
	assert.Equal(t, events, e.updates.Events(), "the db-updates feed said nothing meanwhile")
	assert.Greater(t, metric(t, e.cfg.HTTPAddr, "spiegel_hot_feed_publishes_total"), publishes, "the job came from the hot feed")
	e.quiet(t, rep, db)

	// The job is settled, so the feed covers the db: the held events add no job.
	before := covered(t, e.cfg.HTTPAddr)
	e.updates.Release()
	require.Eventually(t, func() bool { return covered(t, e.cfg.HTTPAddr) > before }, 10*time.Second, 20*time.Millisecond,
		"the db-updates event of a covered db was not passed over")
	e.noJobFor(t, rep, db, 500*time.Millisecond)
}

// Dbs written once each, as many as the feed limit and more, open no hot feed: a feed is earned
// by a db's events coming close together, not by one write.
func TestHotFeedNotForDBsWrittenOnce(t *testing.T) {
	e := newHotEnv(t, 4)
	var dbs []string
	for i := range 12 {
		db := fmt.Sprintf("%sonce%02d", e.Prefix, i)
		e.Couch.CreateDB(t, db)
		dbs = append(dbs, db)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "once", "source": "$db_name", "target": e.Prefix + "all"})
	e.startProducer(t)
	for _, db := range dbs {
		e.waitJob(t, rep, db, 20*time.Second)
	}
	e.waitRulesCaughtUp(t)
	e.Purge(t)
	for _, db := range dbs {
		e.Couch.Put(t, db, "once", map[string]any{"x": 1})
	}
	for _, db := range dbs {
		e.waitJob(t, rep, db, 20*time.Second)
	}
	s := healthtest.Scrape(t, e.cfg.HTTPAddr)
	assert.Zero(t, s.Get("spiegel_hot_feeds_opened_total"), "a db written once opened a feed")
	assert.Zero(t, s.Get("spiegel_hot_feeds"))

	// One of them gets busy: it earns a feed.
	e.openHotFeed(t, dbs[0])
	assert.Equal(t, 1.0, metric(t, e.cfg.HTTPAddr, "spiegel_hot_feeds"))
}

// A producer SIGKILLed after passing over events leaves its saved position before them until a
// job published after them is acknowledged, so the next producer reads them again and publishes
// their jobs: nothing a hot feed had not delivered yet is lost.
func TestHotFeedKilledProducerReadsPassedOverEventsAgain(t *testing.T) {
	e := newHotEnv(t, 0)
	db, other := e.Prefix+"hot", e.Prefix+"other"
	for _, name := range []string{db, other} {
		e.Couch.CreateDB(t, name)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "(hot|other)$", "source": "$db_name", "target": e.Prefix + "all"})
	addr := healthtest.FreeAddr(t)
	cmd := e.startProcess(t, "SPIEGEL_HOT_FEEDS=10", "SPIEGEL_HOT_FEED_IDLE=1m", "SPIEGEL_HTTP_ADDR="+addr)
	e.waitJob(t, rep, db, 20*time.Second)
	require.Eventually(t, func() bool { return e.position(t).LastSeq != "" }, 20*time.Second, 20*time.Millisecond, "no position saved")
	e.writeUntil(t, db, 30*time.Second, func() bool { return covered(t, addr) > 0 }, "event of hot passed over")

	// A later event is handled and a save is due, yet the saved position stays before the
	// passed-over event: no job of hot was published after it.
	e.Purge(t)
	e.Couch.Put(t, other, "x", map[string]any{})
	e.updates.Flush()
	e.waitJob(t, rep, other, 20*time.Second)
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		require.True(t, e.hasEventOf(t, db, e.position(t).LastSeq), "the saved position passed the passed-over event")
	}
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()

	e.Purge(t)
	e.cfg.HTTPAddr = ""
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
}

// A feed closed as idle, having delivered every change, publishes nothing: one _changes request
// after its last seq shows it.
func TestHotFeedIdleClosesQuietly(t *testing.T) {
	e := newHotEnv(t, 10)
	e.cfg.HotFeedIdle = 3 * time.Second
	db := e.Prefix + "quiet"
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	e.waitRulesCaughtUp(t)
	e.writeUntil(t, db, 30*time.Second, func() bool { return covered(t, e.cfg.HTTPAddr) > 0 }, "event of quiet passed over")
	e.quiet(t, rep, db)
	closedIdle := func() float64 {
		s := healthtest.Scrape(t, e.cfg.HTTPAddr)
		return s.Get("spiegel_hot_feeds_closed_total", "reason", publisher.CloseIdle, "then", publisher.CloseThenChecked) +
			s.Get("spiegel_hot_feeds_closed_total", "reason", publisher.CloseIdle, "then", publisher.CloseThenNone)
	}
	require.Eventually(t, func() bool { return closedIdle() == 1 }, 20*time.Second, 50*time.Millisecond, "the feed was not closed as idle")
	assert.Zero(t, metric(t, e.cfg.HTTPAddr, "spiegel_hot_feeds_closed_total", "reason", publisher.CloseIdle, "then", publisher.CloseThenPublished))
	e.noJobFor(t, rep, db, 500*time.Millisecond)
}
