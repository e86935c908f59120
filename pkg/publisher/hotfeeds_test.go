package publisher

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// Hot feeds driven deterministically: the db's _changes connection is a fake the test feeds line
// by line (or cuts), and JetStream's answers are the test's (fakeJobs). What these tests check
// happens in an order the test decides, with no clock in the way.

// fakeChanges is a DBChanges whose continuous feeds the test drives.
type fakeChanges struct {
	mu     sync.Mutex
	feeds  map[string]chan fakeLine
	opened chan string
	// after answers a one-shot _changes request after a seq: the rows there are
	after   func(db, since string) ([]couch.Change, error)
	queries []string // "db since" of each one-shot request
}

// fakeLine is a change on a feed, or the end of its connection with err.
type fakeLine struct {
	seq string
	err error
}

func newFakeChanges() *fakeChanges {
	return &fakeChanges{feeds: map[string]chan fakeLine{}, opened: make(chan string, 16),
		after: func(string, string) ([]couch.Change, error) { return nil, nil }}
}

func (f *fakeChanges) WatchChanges(ctx context.Context, db string, _ couch.ChangesOptions, _ func(), emit func(couch.Change) error) error {
	ch := make(chan fakeLine)
	f.mu.Lock()
	f.feeds[db] = ch
	f.mu.Unlock()
	f.opened <- db
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case l := <-ch:
			if l.err != nil {
				return l.err
			}
			if err := emit(couch.Change{Seq: l.seq, ID: "doc"}); err != nil {
				return err
			}
		}
	}
}

func (f *fakeChanges) Changes(_ context.Context, db string, opt couch.ChangesOptions) (couch.ChangesPage, error) {
	f.mu.Lock()
	f.queries = append(f.queries, db+" "+opt.Since)
	after := f.after
	f.mu.Unlock()
	rows, err := after(db, opt.Since)
	return couch.ChangesPage{Results: rows}, err
}

// send puts a line on db's open feed.
func (f *fakeChanges) send(t *testing.T, db string, l fakeLine) {
	t.Helper()
	f.mu.Lock()
	ch := f.feeds[db]
	f.mu.Unlock()
	require.NotNil(t, ch, "no feed of %s", db)
	select {
	case ch <- l:
	case <-time.After(10 * time.Second):
		t.Fatalf("the feed of %s did not take a line", db)
	}
}

func (f *fakeChanges) oneShots() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.queries...)
}

type hotRig struct {
	hot     *HotFeeds
	pub     *Pipeline
	jobs    *fakeJobs
	couch   *fakeChanges
	m       *metrics.Producer
	publish chan string // db of every job published (one group)
	stop    context.CancelFunc
	done    chan struct{}
}

// newHotRig runs hot feeds (at most maxFeeds, closed after idle) over a fake CouchDB and a
// pipeline over fakeJobs; every db has one rule (replicate).
func newHotRig(t *testing.T, maxFeeds int, idle time.Duration) *hotRig {
	t.Helper()
	r := &hotRig{jobs: newFakeJobs(), couch: newFakeChanges(), m: metrics.NewProducer(prometheus.NewRegistry())}
	log := logrus.New()
	log.SetOutput(io.Discard)
	r.pub = New(r.jobs, 64, r.m, log)
	r.pub.ackTimeout = time.Hour
	r.pub.SetSafe("0")
	ctx, cancel := context.WithCancel(context.Background())
	go r.pub.Run(ctx, time.Second)
	r.hot = NewHotFeeds(r.couch, r.pub, func(string) []events.Group { return []events.Group{events.GroupReplicate} },
		maxFeeds, idle, time.Second, r.m, log)
	r.stop, r.done = cancel, make(chan struct{})
	go func() { defer close(r.done); r.hot.Run(ctx) }()
	require.Eventually(t, func() bool { return r.hot.runCtx() != nil }, 5*time.Second, time.Millisecond)
	t.Cleanup(func() { r.stopAll(t) })
	return r
}

func (r *hotRig) stopAll(t *testing.T) {
	r.stop()
	select {
	case <-r.done:
	case <-time.After(10 * time.Second):
		t.Error("hot feeds did not stop")
	}
	r.pub.Wait()
}

// openFeed makes db busy (as many db-updates events as earn a feed) and waits for its feed to
// connect.
func (r *hotRig) openFeed(t *testing.T, db string) {
	t.Helper()
	for range r.streak() {
		r.hot.Seen(db)
	}
	select {
	case got := <-r.couch.opened:
		require.Equal(t, db, got)
	case <-time.After(10 * time.Second):
		t.Fatalf("no feed of %s opened", db)
	}
}

// deliver sends a change on db's feed, answers the job the feed publishes for it and waits
// until the feed covers the db (the job settled).
func (r *hotRig) deliver(t *testing.T, db, seq string) {
	t.Helper()
	n := r.jobs.publishes(db)
	r.couch.send(t, db, fakeLine{seq: seq})
	r.waitPublish(t, db, n+1)
	r.jobs.answer(db, nil)
	require.Eventually(t, func() bool {
		r.hot.mu.Lock()
		defer r.hot.mu.Unlock()
		f := r.hot.feeds[db]
		return f != nil && f.covers && f.settled == f.delivered
	}, 10*time.Second, time.Millisecond, "the feed of %s does not cover it", db)
}

// waitPublish waits until db's job has been published n times.
func (r *hotRig) waitPublish(t *testing.T, db string, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return r.jobs.publishes(db) >= n }, 10*time.Second, time.Millisecond,
		"%s's job was not published %d times", db, n)
}

// cover passes over a db-updates event of db at seq, as the producer does.
func (r *hotRig) cover(t *testing.T, db, seq string) {
	t.Helper()
	h := r.hot.Cover(db)
	require.NotNil(t, h, "the event of %s is not covered", db)
	require.NoError(t, r.pub.Covered(t.Context(), seq, h))
	require.Eventually(t, func() bool { return r.pub.Safe() == seq }, 10*time.Second, time.Millisecond)
}

// streak is how many db-updates events in a row earn a db its feed now.
func (r *hotRig) streak() int {
	r.hot.mu.Lock()
	defer r.hot.mu.Unlock()
	return r.hot.events
}

func (r *hotRig) candidate() (string, bool) {
	seq, _, held := r.pub.SaveCandidate()
	return seq, held
}

func (r *hotRig) closed(why, then string) float64 {
	return testutil.ToFloat64(r.m.HotFeedsClosed.WithLabelValues(why, then))
}

// A db earns a feed by hotEvents db-updates events in a row within the idle time; fewer, or the
// events of other dbs, open none; at the limit a busy db is refused rather than an open feed
// closed.
func TestHotFeedOpensOnlyForBusyDBs(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 1, time.Minute)
	for range hotEvents - 1 {
		for _, db := range []string{"a", "b", "c"} {
			r.hot.Seen(db)
		}
	}
	assert.Zero(t, r.hot.Count(), "fewer events than hotEvents open no feed")
	assert.Zero(t, testutil.ToFloat64(r.m.HotFeedsOpened))

	r.hot.Seen("b")
	require.Eventually(t, func() bool { return r.hot.Count() == 1 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, "b", <-r.couch.opened)
	assert.Equal(t, 1.0, testutil.ToFloat64(r.m.HotFeedsOpened))

	r.hot.Seen("c") // busy, but the one feed allowed is b's
	assert.Equal(t, 1, r.hot.Count())
	assert.Equal(t, 1.0, testutil.ToFloat64(r.m.HotFeedsRefused))
	assert.Equal(t, 1.0, testutil.ToFloat64(r.m.HotFeedsOpened))
	r.hot.mu.Lock()
	_, open := r.hot.feeds["b"]
	r.hot.mu.Unlock()
	assert.True(t, open, "the open feed is kept")
}

// A db whose events come further apart than the idle time never earns a feed; the same events
// close together do.
func TestHotFeedNotForEventsApart(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 4, time.Minute)
	var mu sync.Mutex
	now := time.Now()
	r.hot.mu.Lock()
	r.hot.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	r.hot.mu.Unlock()
	for i := range 2 * hotEvents {
		if i > 0 {
			mu.Lock()
			now = now.Add(time.Minute + time.Second) // the events of a db written now and then
			mu.Unlock()
		}
		r.hot.Seen("slow")
	}
	for range hotEvents - 2 {
		r.hot.Seen("slow")
	}
	assert.Zero(t, r.hot.Count())
	r.hot.Seen("slow") // the last of hotEvents within the idle time
	require.Eventually(t, func() bool { return r.hot.Count() == 1 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, 1.0, testutil.ToFloat64(r.m.HotFeedsOpened))
}

// Each feed that closes idle without paying (fewer than payingChanges changes) makes a db need
// one more event in a row to earn the next, up to maxHotEvents; one that paid lowers the bar by
// one. Without it, dbs written now and then by chance three times in a row (N = 10,000) keep
// opening feeds that deliver nothing.
func TestHotFeedStreakFollowsWhetherFeedsPay(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 4, 500*time.Millisecond)
	assert.Equal(t, float64(hotEvents), testutil.ToFloat64(r.m.HotFeedStreak))
	for i := range maxHotEvents - hotEvents + 1 { // one more than there is room for: the bar stops at the top
		r.openFeed(t, fmt.Sprintf("quiet%d", i))
		r.deliver(t, fmt.Sprintf("quiet%d", i), "1") // one change does not pay for the feed
		require.Eventually(t, func() bool { return r.closed(CloseIdle, CloseThenNone) == float64(i+1) }, 10*time.Second, time.Millisecond)
		assert.Equal(t, min(hotEvents+i+1, maxHotEvents), r.streak(), "after %d feeds that did not pay", i+1)
	}
	assert.Equal(t, float64(maxHotEvents), testutil.ToFloat64(r.m.HotFeedStreak))

	for range maxHotEvents - 1 {
		r.hot.Seen("busy")
	}
	assert.Zero(t, r.hot.Count(), "one event short of the bar opens no feed")
	r.hot.Seen("busy")
	select {
	case got := <-r.couch.opened:
		require.Equal(t, "busy", got)
	case <-time.After(10 * time.Second):
		t.Fatal("no feed of busy opened at the bar")
	}
	r.deliver(t, "busy", "1")
	r.deliver(t, "busy", "2")
	require.Eventually(t, func() bool { return r.closed(CloseIdle, CloseThenNone) == float64(maxHotEvents-hotEvents+2) }, 10*time.Second, time.Millisecond)
	assert.Equal(t, maxHotEvents-1, r.streak(), "a feed that paid lowers the bar")
	assert.Equal(t, float64(maxHotEvents-1), testutil.ToFloat64(r.m.HotFeedStreak))
}

// The saved position stays before an event a hot feed passed over until a job published after
// the event is acknowledged. Here the feed stalls after its last change and is torn down, the
// db has a change the feed never delivered, and JetStream does not answer the job published
// for it: however long that lasts, the candidate stays before the event (before the fix, the
// hold ended after 30 s and the position passed an event whose change nobody had published).
func TestHotFeedHoldReleasedByAcknowledgement(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 4, time.Hour)
	r.openFeed(t, "hot")
	r.deliver(t, "hot", "5")
	r.cover(t, "hot", "e1")
	seq, held := r.candidate()
	assert.Equal(t, "0", seq)
	assert.True(t, held)

	// A change after the event, whose job JetStream does not answer: still held.
	r.couch.send(t, "hot", fakeLine{seq: "6"})
	r.waitPublish(t, "hot", 2)
	seq, held = r.candidate()
	assert.Equal(t, "0", seq, "released before its job was acknowledged")
	assert.True(t, held)
	r.jobs.answer("hot", nil)
	require.Eventually(t, func() bool { _, held := r.candidate(); return !held }, 10*time.Second, time.Millisecond,
		"the acknowledgement of a job published after the event releases its hold")
	seq, _ = r.candidate()
	assert.Equal(t, "e1", seq)

	// Another event passed over, then the feed stalls and is torn down; the db has a change the
	// feed never delivered; the job published for it gets no answer.
	r.cover(t, "hot", "e2")
	r.couch.after = func(db, since string) ([]couch.Change, error) {
		return []couch.Change{{Seq: "7", ID: "undelivered"}}, nil
	}
	r.couch.send(t, "hot", fakeLine{err: errors.New("no byte for twice the heartbeat")})
	require.Eventually(t, func() bool { return r.closed(CloseFailed, CloseThenPublished) == 1 }, 10*time.Second, time.Millisecond)
	r.waitPublish(t, "hot", 3)
	assert.Equal(t, []string{"hot 6"}, r.couch.oneShots(), "one _changes request after the last seq delivered")
	for range 3 {
		seq, held = r.candidate()
		assert.Equal(t, "e1", seq, "the position passed an event whose job is not acknowledged")
		assert.True(t, held)
		time.Sleep(20 * time.Millisecond)
	}
	r.jobs.answer("hot", nil)
	require.Eventually(t, func() bool { _, held := r.candidate(); return !held }, 10*time.Second, time.Millisecond)
	seq, _ = r.candidate()
	assert.Equal(t, "e2", seq)
}

// A feed closed as idle, which delivered every change (one _changes request after its last seq
// finds nothing) and whose last publish is settled, releases its holds without publishing.
func TestHotFeedIdleCloseChecksInsteadOfPublishing(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 4, 300*time.Millisecond)
	r.openFeed(t, "q")
	r.deliver(t, "q", "3")
	r.cover(t, "q", "e1")
	require.Eventually(t, func() bool { return r.closed(CloseIdle, CloseThenChecked) == 1 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, []string{"q 3"}, r.couch.oneShots())
	_, held := r.candidate()
	assert.False(t, held)
	assert.Equal(t, 1.0, testutil.ToFloat64(r.m.HotFeedJobs), "no job published at the close")
	assert.Zero(t, r.hot.Count())
}

// A feed that closes with nothing passed over since its last publish costs nothing more.
func TestHotFeedIdleCloseWithoutHolds(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 4, 300*time.Millisecond)
	r.openFeed(t, "q")
	r.deliver(t, "q", "3")
	require.Eventually(t, func() bool { return r.closed(CloseIdle, CloseThenNone) == 1 }, 10*time.Second, time.Millisecond)
	assert.Empty(t, r.couch.oneShots())
}

// Stopping leaves the holds: the saved position stays before the events passed over, so the
// next producer reads them again.
func TestHotFeedStopKeepsHolds(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 4, time.Hour)
	r.openFeed(t, "s")
	r.deliver(t, "s", "3")
	r.cover(t, "s", "e1")
	r.stop()
	<-r.done
	assert.Equal(t, 1.0, r.closed(CloseStopped, CloseThenHeld))
	seq, held := r.candidate()
	assert.Equal(t, "0", seq)
	assert.True(t, held)
}

// A deleted db wants no job: its feed's holds are released.
func TestHotFeedDeletedDBReleases(t *testing.T) {
	t.Parallel()
	r := newHotRig(t, 4, time.Hour)
	r.openFeed(t, "d")
	r.deliver(t, "d", "3")
	r.cover(t, "d", "e1")
	r.hot.Close("d", CloseDeleted)
	require.Eventually(t, func() bool { return r.closed(CloseDeleted, CloseThenNone) == 1 }, 10*time.Second, time.Millisecond)
	_, held := r.candidate()
	assert.False(t, held)
	assert.Empty(t, r.couch.oneShots())
}
