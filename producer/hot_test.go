package main

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Hot feeds: the proxy serves its own _db_updates feed (couchtest.AlwaysSynthesize) on both
// servers, so that a test can hold it back and see what the hot feeds do alone.

const passedOver = "db update passed over"

func newHotEnv(t *testing.T, feeds int) *env {
	t.Helper()
	e := newEnv(t, couchtest.AlwaysSynthesize())
	e.cfg.HotFeeds, e.cfg.HotFeedIdle = feeds, time.Minute
	return e
}

// passedOverFor reports whether the logs say a db-updates event of db was passed over.
func (e *env) passedOverFor(db string) bool {
	for _, line := range strings.Split(e.Logs.String(), "\n") {
		if strings.Contains(line, passedOver) && strings.Contains(line, `"db":"`+db+`"`) {
			return true
		}
	}
	return false
}

// writeUntil writes a new doc to db every 200 ms until cond holds, for up to within: a hot feed
// opens shortly after the event of a first write, and only changes after it are its own.
func (e *env) writeUntil(t *testing.T, db string, within time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for i := 0; !cond(); i++ {
		require.True(t, time.Now().Before(deadline), "no %s within %s", what, within)
		e.Couch.Put(t, db, fmt.Sprintf("w%s%04d", db[len(db)-1:], i), map[string]any{"i": i})
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
	e.Purge(t)
	e.Couch.Put(t, db, "first", map[string]any{})
	e.waitJob(t, rep, db, 20*time.Second) // from its db-updates event, which opens the feed
	e.Purge(t)

	e.updates.Hold()
	events := e.updates.Events()
	e.writeUntil(t, db, 20*time.Second, func() bool { return e.Pending(t)[work(rep, db)] == 1 }, "job from the hot feed")
	assert.Equal(t, events, e.updates.Events(), "the db-updates feed said nothing meanwhile")
	e.quiet(t, rep, db)

	// The job is settled, so the feed covers the db: the held events add no job.
	e.updates.Release()
	require.Eventually(t, func() bool { return e.passedOverFor(db) }, 10*time.Second, 20*time.Millisecond,
		"the db-updates event of a covered db was not passed over")
	e.noJobFor(t, rep, db, 500*time.Millisecond)
}

// A hot feed that ends after passing over an event publishes its db's jobs once more: here it is
// evicted by the feed of another db (SPIEGEL_HOT_FEEDS=1).
func TestHotFeedEvictedPublishesAgain(t *testing.T) {
	e := newHotEnv(t, 1)
	a, b := e.Prefix+"a", e.Prefix+"b"
	for _, db := range []string{a, b} {
		e.Couch.CreateDB(t, db)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "[ab]$", "source": "$db_name", "target": e.Prefix + "all"})
	e.startProducer(t)
	e.waitJob(t, rep, a, 20*time.Second)
	e.waitJob(t, rep, b, 20*time.Second)
	e.writeUntil(t, a, 30*time.Second, func() bool { return e.passedOverFor(a) }, "event of a passed over")
	e.Purge(t)

	e.Couch.Put(t, b, "x", map[string]any{})
	e.waitJob(t, rep, b, 20*time.Second)
	e.waitJob(t, rep, a, 20*time.Second)
	assert.Equal(t, events.TypeUpdated, e.jobReason(t, rep, a))
}

// A producer SIGKILLed after passing over events leaves its saved position before them (for the
// hold time), so the next producer reads them again and publishes their jobs: nothing a hot feed
// had not delivered yet is lost.
func TestHotFeedKilledProducerReadsPassedOverEventsAgain(t *testing.T) {
	e := newHotEnv(t, 0)
	db, other := e.Prefix+"hot", e.Prefix+"other"
	for _, name := range []string{db, other} {
		e.Couch.CreateDB(t, name)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "(hot|other)$", "source": "$db_name", "target": e.Prefix + "all"})
	cmd := e.startProcess(t, "SPIEGEL_HOT_FEEDS=10", "SPIEGEL_LOG_LEVEL=debug", "SPIEGEL_LOG_FORMAT=json")
	e.waitJob(t, rep, db, 20*time.Second)
	require.Eventually(t, func() bool { return e.position(t).LastSeq != "" }, 20*time.Second, 20*time.Millisecond, "no position saved")
	e.writeUntil(t, db, 30*time.Second, func() bool { return e.passedOverFor(db) }, "event of hot passed over")

	// A later event is handled and a save is due, yet the saved position stays before the
	// passed-over event.
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
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
}

// A feed closed as idle publishes nothing: it stayed up longer after its last change than a
// stalled feed lasts, so it delivered every change whose event it passed over.
func TestHotFeedIdleClosesQuietly(t *testing.T) {
	e := newHotEnv(t, 10)
	e.cfg.HotFeedIdle = 5 * time.Second // more than twice the heartbeat (2s)
	db := e.Prefix + "quiet"
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	e.waitRulesCaughtUp(t)
	e.writeUntil(t, db, 30*time.Second, func() bool { return e.passedOverFor(db) }, "event of quiet passed over")
	e.quiet(t, rep, db)
	require.Eventually(t, func() bool {
		return strings.Contains(e.Logs.String(), `"msg":"hot feed closed","reason":"idle"`)
	}, 20*time.Second, 50*time.Millisecond, "the feed was not closed as idle")
	e.noJobFor(t, rep, db, 500*time.Millisecond)
}
