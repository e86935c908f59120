package couch

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// realClient returns the test server and a client for it.
func realClient(t *testing.T) (*couchtest.Server, *Client) {
	t.Helper()
	srv := couchtest.Get(t)
	c, _ := newTestClient(t, srv.URL)
	c.timeout = DefaultRequestTimeout // a shared test server can be slow under load
	return srv, c
}

// only keeps the events of the named dbs (other tests share the server).
func only(evs []DBEvent, dbs ...string) []DBEvent {
	var out []DBEvent
	for _, ev := range evs {
		for _, db := range dbs {
			if ev.DB == db {
				ev.Seq = strings.TrimSpace(ev.Seq)
				out = append(out, ev)
			}
		}
	}
	return out
}

func TestRealServerInfo(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	info, err := c.Server(t.Context())
	require.NoError(t, err)
	assert.Equal(t, srv.PouchDB, info.PouchDB)
	assert.Equal(t, !srv.PouchDB, info.CouchDB)
	assert.Equal(t, srv.Version, info.Version)
	assert.Positive(t, info.Major)

	db := srv.NewDB(t, "kivik_")
	exists, err := c.Kivik().DBExists(t.Context(), db)
	require.NoError(t, err)
	assert.True(t, exists, "the kivik client shares the transport and credentials")
}

func TestRealAutoSource(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	feed, err := c.NewUpdatesFeed(t.Context(), SourceAuto, FeedOptions{})
	require.NoError(t, err)
	if srv.PouchDB {
		assert.Equal(t, SourcePoll, feed.Source(), "PouchDB Server has neither _db_updates nor _global_changes")
	} else {
		// CouchDB 2/3 serve _db_updates once _global_changes exists (install creates it).
		err := srv.Do(t, http.MethodPut, "/_global_changes", nil, nil)
		if err != nil && !strings.Contains(err.Error(), "412") {
			require.NoError(t, err)
		}
		feed, err = c.NewUpdatesFeed(t.Context(), SourceAuto, FeedOptions{})
		require.NoError(t, err)
		assert.Equal(t, SourceDBUpdates, feed.Source())
	}
	_, err = c.NewUpdatesFeed(t.Context(), "carrier_pigeon", FeedOptions{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "auto, db_updates, global_changes, poll")
}

func TestRealPollFeed(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name         string
		since        string
		wantExisting bool // an "updated" event for the db that existed before the start
	}{
		{"since now: existing dbs are the baseline", SinceNow, false},
		{"since beginning: existing dbs are reported", "", true},
		{"since a saved poll position: existing dbs are reported", PollSeq, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := couchtest.Get(t)
			c, logs := newTestClient(t, srv.URL)
			existing := srv.NewDB(t, "poll_old_")
			fresh := couchtest.UniqueName(t, "poll_new_")
			// Match keeps the poller off other tests' dbs: on PouchDB Server a GET /{db} racing a
			// DELETE of that db brings it back.
			mine := func(db string) bool { return db == existing || db == fresh }
			feed, err := c.NewUpdatesFeed(t.Context(), SourcePoll, FeedOptions{PollInterval: 50 * time.Millisecond, Match: mine})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			var got collector[DBEvent]
			done := runAsync(func() error { return feed.Run(ctx, tt.since, got.emit) })
			// The db below must not be in the first round: wait until that round is done.
			require.Eventually(t, func() bool { return strings.Contains(logs.String(), "poll round done") },
				10*time.Second, 5*time.Millisecond)

			srv.CreateDB(t, fresh)
			require.Eventually(t, func() bool { return len(only(got.get(), fresh)) == 1 }, 10*time.Second, 10*time.Millisecond)
			srv.Put(t, fresh, "doc1", map[string]any{"n": 1})
			require.Eventually(t, func() bool { return len(only(got.get(), fresh)) == 2 }, 10*time.Second, 10*time.Millisecond)
			destroyed := time.Time{}
			require.Eventually(t, func() bool {
				evs := only(got.get(), fresh)
				if evs[len(evs)-1].Type == "deleted" {
					return true
				}
				// PouchDB Server may resurrect a db whose DELETE raced the poller's GET: delete again.
				if time.Since(destroyed) > time.Second {
					destroyed = time.Now()
					_ = srv.Client.DestroyDB(t.Context(), fresh)
				}
				return false
			}, 10*time.Second, 10*time.Millisecond, "events: %v", only(got.get(), fresh))
			cancel()
			require.ErrorIs(t, waitDone(t, done), context.Canceled)

			// A poller may see intermediate states (an extra updated), never a wrong order.
			evs := only(got.get(), fresh)
			t.Logf("events of the new db: %v", evs)
			assert.Equal(t, DBEvent{DB: fresh, Type: "created", Seq: PollSeq}, evs[0])
			assert.Equal(t, DBEvent{DB: fresh, Type: "deleted", Seq: PollSeq}, evs[len(evs)-1])
			require.Greater(t, len(evs), 2)
			for _, ev := range evs[1 : len(evs)-1] {
				assert.Equal(t, DBEvent{DB: fresh, Type: "updated", Seq: PollSeq}, ev)
			}
			if tt.wantExisting {
				assert.Equal(t, []DBEvent{{DB: existing, Type: "updated", Seq: PollSeq}}, only(got.get(), existing))
			} else {
				assert.Empty(t, only(got.get(), existing), "the first round with since=now is only the baseline")
			}
		})
	}
}

func TestRealFollowChanges(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	db := srv.NewDB(t, "follow_")
	srv.Put(t, db, "before", map[string]any{"n": 0})

	// Start from now: only docs written afterwards arrive.
	ctx, cancel := context.WithCancel(t.Context())
	var first collector[Change]
	done := runAsync(func() error {
		return c.FollowChanges(ctx, db, ChangesOptions{Since: SinceNow, IncludeDocs: true, Heartbeat: time.Second}, first.emit)
	})
	// "now" is resolved when the feed starts, at a moment the test cannot see: write probe docs
	// until one arrives, so that the feed is surely live before a1 and a2 are written.
	for i := 0; first.len() == 0; i++ {
		require.Less(t, i, 200, "the feed never saw a probe doc")
		srv.Put(t, db, fmt.Sprintf("probe%d", i), map[string]any{})
		time.Sleep(50 * time.Millisecond) // pacing of the probe writes, not a synchronisation
	}
	srv.Put(t, db, "a1", map[string]any{"n": 1})
	srv.Put(t, db, "a2", map[string]any{"n": 2})
	require.Eventually(t, func() bool { return slices.Contains(ids(first.get()), "a2") }, 10*time.Second, 10*time.Millisecond)
	cancel()
	require.ErrorIs(t, waitDone(t, done), context.Canceled)
	got := first.get()
	assert.NotContains(t, ids(got), "before", "since=now skips what was there")
	require.GreaterOrEqual(t, len(got), 3)
	assert.True(t, strings.HasPrefix(got[0].ID, "probe"))
	assert.Equal(t, []string{"a1", "a2"}, ids(got[len(got)-2:]))
	assert.Contains(t, string(got[len(got)-2].Doc), `"n":1`)
	saved := got[len(got)-1].Seq

	// Restart from the saved seq: only what came after it.
	srv.Put(t, db, "b1", map[string]any{"n": 3})
	ctx, cancel = context.WithCancel(t.Context())
	var second collector[Change]
	done = runAsync(func() error {
		return c.FollowChanges(ctx, db, ChangesOptions{Since: saved, Heartbeat: time.Second}, second.emit)
	})
	require.Eventually(t, func() bool { return second.len() >= 1 }, 10*time.Second, 10*time.Millisecond)
	srv.Put(t, db, "b2", map[string]any{"n": 4})
	require.Eventually(t, func() bool { return second.len() >= 2 }, 10*time.Second, 10*time.Millisecond)
	cancel()
	require.ErrorIs(t, waitDone(t, done), context.Canceled)
	assert.Equal(t, []string{"b1", "b2"}, ids(second.get()))
	assert.Nil(t, second.get()[0].Doc, "no include_docs")
}

func ids(chs []Change) []string {
	var out []string
	for _, ch := range chs {
		out = append(out, ch.ID)
	}
	return out
}

func TestRealChangesPaging(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	db := srv.NewDB(t, "paging_")
	for i := range 5 {
		srv.Put(t, db, fmt.Sprintf("d%d", i), map[string]any{"n": i})
	}
	rev := srv.Put(t, db, "gone", map[string]any{})
	require.NoError(t, srv.Do(t, http.MethodDelete, "/"+couchtest.PathDB(db)+"/gone?rev="+rev, nil, nil))

	var seen []Change
	since := ""
	var sizes []int
	for range 10 {
		page, err := c.Changes(t.Context(), db, ChangesOptions{Since: since, Limit: 2})
		require.NoError(t, err)
		require.NotEmpty(t, page.LastSeq)
		sizes = append(sizes, len(page.Results))
		seen = append(seen, page.Results...)
		if len(page.Results) == 0 {
			break
		}
		since = page.LastSeq
	}
	assert.Equal(t, []int{2, 2, 2, 0}, sizes)
	assert.ElementsMatch(t, []string{"d0", "d1", "d2", "d3", "d4", "gone"}, ids(seen))
	for _, ch := range seen {
		assert.Equal(t, ch.ID == "gone", ch.Deleted, ch.ID)
		assert.Len(t, ch.Revs, 1)
	}

	_, err := c.Changes(t.Context(), db+"_missing", ChangesOptions{})
	require.ErrorIs(t, err, ErrNotFound)
}

// DBMissing tells a missing db's 404 from a missing doc's, on the server under test (CouchDB
// 2+ and PouchDB Server word them differently).
func TestRealDBMissing(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	db := srv.NewDB(t, "dbmissing_")
	var he *HTTPError
	err := c.Do(t.Context(), http.MethodGet, c.DBPath(db)+"/nodoc", nil, nil, nil)
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusNotFound, he.Status)
	assert.False(t, he.DBMissing(), "a missing doc in a db that exists: %v", he)

	err = c.Do(t.Context(), http.MethodGet, c.DBPath(db+"_missing")+"/nodoc", nil, nil, nil)
	require.ErrorAs(t, err, &he)
	assert.True(t, he.DBMissing(), "a doc of a missing db: %v", he)
	_, err = c.Changes(t.Context(), db+"_missing", ChangesOptions{})
	require.ErrorAs(t, err, &he)
	assert.True(t, he.DBMissing(), "the changes of a missing db: %v", he)
}

// ChangedSince answers from the server: nothing after the db's update_seq (whichever copies it
// names on a cluster), a change after a seq read before a write.
func TestRealChangedSince(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	db := srv.NewDB(t, "changedsince_")
	srv.Put(t, db, "a", map[string]any{})
	info, err := c.DBInfo(t.Context(), db)
	require.NoError(t, err)
	changed, err := c.ChangedSince(t.Context(), db, info.UpdateSeq)
	require.NoError(t, err)
	assert.False(t, changed, "nothing after the update_seq")
	srv.Put(t, db, "b", map[string]any{})
	changed, err = c.ChangedSince(t.Context(), db, info.UpdateSeq)
	require.NoError(t, err)
	assert.True(t, changed, "a write after the update_seq")

	_, err = c.ChangedSince(t.Context(), db+"_missing", info.UpdateSeq)
	require.ErrorIs(t, err, ErrNotFound)
}

// assertSameState asserts that got and want are seqs of one state of db: equal, or (one state
// sent as different strings) with no change after either, as CouchDB says (the seqs are not read).
func assertSameState(t *testing.T, c *Client, db, want, got string) {
	t.Helper()
	if want == got {
		return
	}
	for _, since := range []string{want, got} {
		changed, err := c.ChangedSince(t.Context(), db, since)
		require.NoError(t, err)
		assert.False(t, changed, "%s changed after %q: %q and %q are seqs of different states", db, since, want, got)
	}
}

func TestRealDBInfo(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	tests := []struct {
		name   string
		prefix string
		slash  bool
	}{
		{"plain", "info_", false},
		{"special characters", "ab+c$d(e)-f_g", false},
		{"slash", "ab/c_", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if tt.slash && srv.PouchDB {
				t.Skip("PouchDB Server cannot use a db name containing '/': it strips %2F from paths")
			}
			name := couchtest.UniqueName(t, tt.prefix)
			srv.CreateDB(t, name)
			srv.Put(t, name, "doc", map[string]any{"x": 1})

			info, err := c.DBInfo(t.Context(), name)
			require.NoError(t, err)
			assert.Equal(t, name, info.Name)
			assert.Equal(t, int64(1), info.DocCount)
			assert.NotEmpty(t, info.UpdateSeq)

			infos, err := c.DBInfos(t.Context(), []string{name, name + "_missing"})
			require.NoError(t, err)
			require.Len(t, infos, 1)
			assertSameState(t, c, name, info.UpdateSeq, infos[name].UpdateSeq)
			infos[name] = DBInfo{Name: info.Name, UpdateSeq: info.UpdateSeq, InstanceStartTime: infos[name].InstanceStartTime, DocCount: infos[name].DocCount}
			assert.Equal(t, map[string]DBInfo{name: info}, infos)

			page, err := c.Changes(t.Context(), name, ChangesOptions{IncludeDocs: true})
			require.NoError(t, err)
			require.Len(t, page.Results, 1)
			assert.Equal(t, "doc", page.Results[0].ID)

			snap, err := c.TakeSnapshot(t.Context(), func(db string) bool { return db == name })
			require.NoError(t, err)
			require.Len(t, snap, 1)
			assertSameState(t, c, name, info.UpdateSeq, snap[name])

			var listed bool
			require.NoError(t, c.EachDB(t.Context(), func(db string) error {
				listed = listed || db == name
				return nil
			}))
			assert.True(t, listed)

			_, err = c.DBInfo(t.Context(), name+"_missing")
			require.ErrorIs(t, err, ErrNotFound)
		})
	}
}

func TestRealAllDBsPages(t *testing.T) {
	t.Parallel()
	srv, c := realClient(t)
	prefix := couchtest.UniqueName(t, "pages_")
	var want []string
	for i := range 5 {
		name := fmt.Sprintf("%s_%d", prefix, i)
		srv.CreateDB(t, name)
		want = append(want, name)
	}
	var got []string
	after := prefix
	for {
		page, err := c.AllDBs(t.Context(), after, 2)
		require.NoError(t, err)
		require.LessOrEqual(t, len(page), 2)
		for _, db := range page {
			if strings.HasPrefix(db, prefix) {
				got = append(got, db)
			}
		}
		if len(page) < 2 || !strings.HasPrefix(page[len(page)-1], prefix) {
			break
		}
		after = page[len(page)-1]
	}
	assert.Equal(t, want, got)
}

// startTimes is a RoundTripper that notes when each request for the db infos was sent: POST
// /_dbs_info, or GET /{db} of a db whose name has prefix.
type startTimes struct {
	next   http.RoundTripper
	prefix string
	mu     sync.Mutex
	at     []time.Time
}

func (s *startTimes) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Path == "/_dbs_info" || r.Method == http.MethodGet && strings.HasPrefix(strings.TrimPrefix(r.URL.Path, "/"), s.prefix) {
		s.mu.Lock()
		s.at = append(s.at, time.Now())
		s.mu.Unlock()
	}
	return s.next.RoundTrip(r)
}

func (s *startTimes) span() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.at) == 0 {
		return 0
	}
	return slices.MaxFunc(s.at, time.Time.Compare).Sub(slices.MinFunc(s.at, time.Time.Compare))
}

// TestSnapshotSpread: a spread snapshot reads the same infos as one at once, a batch at a time
// with the batches spread over the time asked (5 dbs in batches of 2: two waits of a third of
// it), but never more than maxSpreadGap apart, and it ends with its context.
func TestSnapshotSpread(t *testing.T) {
	t.Parallel()
	srv := couchtest.Get(t)
	prefix := couchtest.UniqueName(t, "spread") + "_"
	for i := range 5 {
		name := fmt.Sprintf("%s%d", prefix, i)
		srv.CreateDB(t, name)
		srv.Put(t, name, "doc", map[string]any{"i": i})
	}
	rec := &startTimes{next: http.DefaultTransport, prefix: prefix}
	c, err := New(Config{URL: srv.URL, RequestTimeout: DefaultRequestTimeout, Transport: rec}, nil)
	require.NoError(t, err)
	match := func(db string) bool { return strings.HasPrefix(db, prefix) }

	atOnce, err := c.takeSnapshot(t.Context(), match, 2, 0)
	require.NoError(t, err)
	require.Len(t, atOnce, 5)
	rec.at = nil
	const spread = 900 * time.Millisecond
	spreadSnap, err := c.takeSnapshot(t.Context(), match, 2, spread)
	require.NoError(t, err)
	require.Len(t, spreadSnap, 5)
	for db, seq := range atOnce {
		assertSameState(t, c, db, seq, spreadSnap[db])
	}
	assert.GreaterOrEqual(t, rec.span(), 2*spread/3, "three batches, two waits of a third of the spread between them")
	rec.at = nil
	start := time.Now()
	_, err = c.takeSnapshot(t.Context(), match, 2, time.Hour)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, rec.span(), 2*maxSpreadGap, "two waits")
	assert.Less(t, time.Since(start), 30*time.Second, "the batches are at most maxSpreadGap apart, not a third of the hour")

	ctx, cancel := context.WithTimeout(t.Context(), spread/2)
	defer cancel()
	_, err = c.takeSnapshot(ctx, match, 1, time.Hour) // returns at the first wait
	require.Error(t, err, "a spread snapshot ends with its context")
}
