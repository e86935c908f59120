package couch

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Events and changes exactly as recorded from CouchDB 3.3.3 in ../../../shared/fixtures/couchdb-3.3.
var (
	fxLiveEvents = []DBEvent{
		{DB: "fx_late", Type: "created", Seq: "16-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBApyii"},
		{DB: "_dbs", Type: "updated", Seq: "17-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBBFyij"},
		{DB: "fx_late", Type: "updated", Seq: "18-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CGmWZqam6eaY9OXBQBBOSik"},
		{DB: "fx_late", Type: "deleted", Seq: "19-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTeXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CGmWZqam6eaY9OXBQBBqSil"},
		{DB: "_dbs", Type: "updated", Seq: "20-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTeXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CGmWZqam6eaY9OXBQBCGSim"},
	}
	fxNormalEvents = []DBEvent{
		{DB: "db_b", Type: "created", Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGgyIJc"},
		{DB: "db_b", Type: "updated", Seq: "4-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTWXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGkcIJo"},
		{DB: "db_c", Type: "created", Seq: "5-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTWXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGlqIJs"},
		{DB: "db_c", Type: "updated", Seq: "7-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgT2XOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGoGIJ0"},
		{DB: "fx_tgt", Type: "created", Seq: "8-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGpUIJ4"},
		{DB: "db_a", Type: "created", Seq: "9-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DTGCGmWZqam6eaY9OXBQA_HSib"},
		{DB: "db_a", Type: "updated", Seq: "11-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DTmCGmWZqam6eaY9OXBQA_YSid"},
		{DB: "fx_src", Type: "created", Seq: "12-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DTWCCmWZqam6eaY9OXBQA_gyie"},
		{DB: "fx_src", Type: "updated", Seq: "14-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQA_xyig"},
		{DB: "_dbs", Type: "updated", Seq: "15-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBANyih"},
	}
	fxGlobalEvents  = fxNormalEvents[:5] // _global_changes holds the same events under the same seqs
	fxGlobalLastSeq = "8-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGpUIJ4"
	fxChangesNormal = []Change{
		{Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFhzIGM", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
		{Seq: "2-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKM0ofw", ID: "doc1", Revs: []string{"1-3b6ffcfff90ac68478e8935efb41a87f"}},
		{Seq: "3-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTGMGmGaUmJZmbG2LTlwUAKT0ogA", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
		{Seq: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
	}
	fxChangesDeletion = []Change{
		{Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFhzIGM", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
		{Seq: "2-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFjBIGQ", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
		{Seq: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
		{Seq: "5-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTmMGmGaUmJZmbG2LTlwUAKYEogg", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
	}
	fxChangesContinuous = []Change{
		{Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFhzIGM", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
		{Seq: "3-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTmMCmGaUmJZmbG2LTlwUAKO8ogA", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
		{Seq: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
		{Seq: "5-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTmMGmGaUmJZmbG2LTlwUAKYEogg", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
	}
)

// collector gathers emitted items for tests.
type collector[T any] struct {
	mu    sync.Mutex
	items []T
}

func (c *collector[T]) emit(item T) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.items = append(c.items, item)
	return nil
}

func (c *collector[T]) get() []T {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]T(nil), c.items...)
}

func (c *collector[T]) len() int { return len(c.get()) }

// runAsync runs fn in a goroutine and returns a channel with its result.
func runAsync(fn func() error) <-chan error {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	return done
}

func waitDone(t *testing.T, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("feed did not return within 10s")
		return nil
	}
}

func TestFixtureUpdatesFeeds(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		source   string
		fixture  string
		since    string
		want     []DBEvent
		wantFeed string // feed of the first request
		nextFrom string // since of the continuous request after the fixture
	}{
		{"db_updates continuous", SourceDBUpdates, "db-updates-continuous-live.http", "", fxLiveEvents, "continuous", fxLiveEvents[4].Seq},
		{"db_updates normal for since=now", SourceDBUpdates, "db-updates-normal.http", SinceNow, fxNormalEvents, "normal", fxNormalEvents[9].Seq},
		{"global_changes normal for since=now", SourceGlobalChanges, "global-changes.http", SinceNow, fxGlobalEvents, "normal", fxGlobalLastSeq},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, tt.fixture)))
			c, _ := newTestClient(t, srv.URL)
			feed, err := c.NewUpdatesFeed(t.Context(), tt.source, FeedOptions{Heartbeat: time.Second})
			require.NoError(t, err)
			assert.Equal(t, tt.source, feed.Source())
			ctx, cancel := context.WithCancel(t.Context())
			var got collector[DBEvent]
			done := runAsync(func() error { return feed.Run(ctx, tt.since, got.emit) })
			require.Eventually(t, func() bool { return srv.count() >= 2 && got.len() >= len(tt.want) },
				5*time.Second, 5*time.Millisecond)
			cancel()
			require.ErrorIs(t, waitDone(t, done), context.Canceled)
			assert.Equal(t, tt.want, got.get())
			reqs := srv.requests()
			assert.Equal(t, tt.wantFeed, reqs[0].Query().Get("feed"))
			assert.Equal(t, tt.since, reqs[0].Query().Get("since"))
			assert.Equal(t, "continuous", reqs[1].Query().Get("feed"))
			assert.Equal(t, tt.nextFrom, reqs[1].Query().Get("since"), "the feed resumes after the last event")
			assert.Equal(t, "1000", reqs[1].Query().Get("heartbeat"))
		})
	}
}

func TestFixtureParseGlobalChangesRows(t *testing.T) {
	t.Parallel()
	var body struct {
		Results []json.RawMessage `json:"results"`
	}
	require.NoError(t, json.Unmarshal(fixtureBody(t, "global-changes.http"), &body))
	var got []DBEvent
	for _, row := range body.Results {
		ev, seq, ok, err := parseGlobalChangesLine(row)
		require.NoError(t, err)
		require.True(t, ok)
		assert.Equal(t, ev.Seq, seq)
		got = append(got, ev)
	}
	assert.Equal(t, fxGlobalEvents, got)
}

func TestFixtureChanges(t *testing.T) {
	t.Parallel()
	tests := []struct {
		fixture     string
		opt         ChangesOptions
		want        []Change
		wantLast    string
		wantPending int64
		wantDocs    bool
		wantQuery   map[string]string
	}{
		{"changes-normal.http", ChangesOptions{IncludeDocs: true, AllDocs: true}, fxChangesNormal, fxChangesNormal[3].Seq, 0, true,
			map[string]string{"include_docs": "true", "style": "all_docs", "feed": "normal"}},
		{"changes-with-deletion.http", ChangesOptions{AllDocs: true}, fxChangesDeletion, fxChangesDeletion[3].Seq, 0, false,
			map[string]string{"style": "all_docs", "include_docs": ""}},
		{"changes-limit.http", ChangesOptions{Limit: 2, Since: "0"}, fxChangesDeletion[:2], fxChangesDeletion[1].Seq, 2, false,
			map[string]string{"limit": "2", "since": "0"}},
	}
	for _, tt := range tests {
		t.Run(tt.fixture, func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, tt.fixture)))
			c, _ := newTestClient(t, srv.URL)
			page, err := c.Changes(t.Context(), "fx_src", tt.opt)
			require.NoError(t, err)
			assert.Equal(t, tt.wantLast, page.LastSeq)
			assert.Equal(t, tt.wantPending, page.Pending)
			require.Len(t, page.Results, len(tt.want))
			for i, ch := range page.Results {
				assert.Equal(t, tt.want[i].ID, ch.ID)
				assert.Equal(t, tt.want[i].Seq, ch.Seq)
				assert.Equal(t, tt.want[i].Deleted, ch.Deleted)
				assert.Equal(t, tt.want[i].Revs, ch.Revs)
				if tt.wantDocs {
					var doc struct {
						ID  string `json:"_id"`
						Rev string `json:"_rev"`
					}
					require.NoError(t, json.Unmarshal(ch.Doc, &doc))
					assert.Equal(t, ch.ID, doc.ID)
					assert.Equal(t, ch.Revs[0], doc.Rev)
				} else {
					assert.Nil(t, ch.Doc)
				}
			}
			q := srv.requests()[0].Query()
			assert.Equal(t, "/fx_src/_changes", srv.requests()[0].Path)
			for k, v := range tt.wantQuery {
				assert.Equal(t, v, q.Get(k), k)
			}
		})
	}
}

func TestFixtureFollowChanges(t *testing.T) {
	t.Parallel()
	srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, "changes-continuous.http")))
	c, _ := newTestClient(t, srv.URL)
	ctx, cancel := context.WithCancel(t.Context())
	var got collector[Change]
	done := runAsync(func() error {
		return c.FollowChanges(ctx, "fx_src", ChangesOptions{IncludeDocs: true, Heartbeat: time.Second}, got.emit)
	})
	require.Eventually(t, func() bool { return srv.count() >= 2 }, 5*time.Second, 5*time.Millisecond)
	cancel()
	require.ErrorIs(t, waitDone(t, done), context.Canceled)
	changes := got.get()
	require.Len(t, changes, len(fxChangesContinuous))
	for i, ch := range changes {
		assert.Equal(t, fxChangesContinuous[i].ID, ch.ID)
		assert.Equal(t, fxChangesContinuous[i].Seq, ch.Seq)
		assert.Equal(t, fxChangesContinuous[i].Deleted, ch.Deleted)
		assert.Equal(t, fxChangesContinuous[i].Revs, ch.Revs)
		assert.NotNil(t, ch.Doc)
	}
	assert.JSONEq(t, `{"_id":"doc1","_rev":"2-e756583c203257552e07a1bfc6aa9047","_deleted":true}`, string(changes[3].Doc))
	assert.Equal(t, fxChangesContinuous[3].Seq, srv.requests()[1].Query().Get("since"))
}

func TestFixtureDBInfos(t *testing.T) {
	t.Parallel()
	var body []byte
	fixture := fixtureBody(t, "dbs-info.http") // read here: t.Skip only works in the test goroutine
	srv := newFakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		body = make([]byte, r.ContentLength)
		_, _ = r.Body.Read(body)
		serveBody(http.StatusOK, fixture)(w, r)
	})
	c, _ := newTestClient(t, srv.URL)
	infos, err := c.DBInfos(t.Context(), []string{"fx_src", "fx_tgt", "fx_missing"})
	require.NoError(t, err)
	assert.JSONEq(t, `{"keys":["fx_src","fx_tgt","fx_missing"]}`, string(body))
	assert.Equal(t, "/_dbs_info", srv.requests()[0].Path)
	require.Len(t, infos, 2)
	assert.NotContains(t, infos, "fx_missing")
	assert.Equal(t, DBInfo{Name: "fx_src", DocCount: 3, InstanceStartTime: "1795316723",
		UpdateSeq: "5-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVB4LkGRoAFL_gSArgzmRORcowG6UmpRkbm6ITR8e0xIZkuqhxjCBjTExt0hONUjCpiELAPIoKII"},
		infos["fx_src"])
	assert.Equal(t, int64(0), infos["fx_tgt"].DocCount)
	assert.Equal(t, "0-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVB4LkGRoAFL_gSArgzmRIRcowG6UbG6ZZGyKTR8e0xIZkupRjEk2Tks2NbLEpiELAOG3KFQ",
		infos["fx_tgt"].UpdateSeq)
}

func TestFixtureSingleAnswers(t *testing.T) {
	t.Parallel()
	t.Run("root", func(t *testing.T) {
		t.Parallel()
		srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, "root.http")))
		c, _ := newTestClient(t, srv.URL)
		info, err := c.Server(t.Context())
		require.NoError(t, err)
		assert.Equal(t, ServerInfo{Vendor: "The Apache Software Foundation", Version: "3.3.3", CouchDB: true, Major: 3}, info)
		again, err := c.Server(t.Context())
		require.NoError(t, err)
		assert.Equal(t, info, again)
		assert.Equal(t, 1, srv.count(), "the server info is cached")
	})
	t.Run("missing db", func(t *testing.T) {
		t.Parallel()
		srv := newFakeServer(t, serveBody(http.StatusNotFound, fixtureBody(t, "get-db-missing.http")))
		c, _ := newTestClient(t, srv.URL)
		_, err := c.DBInfo(t.Context(), "fx_missing")
		require.ErrorIs(t, err, ErrNotFound)
		var he *HTTPError
		require.ErrorAs(t, err, &he)
		assert.Equal(t, HTTPError{Status: 404, ErrorName: "not_found", Reason: "Database does not exist.", Method: "GET", Path: "/fx_missing"}, *he)
	})
	t.Run("get db", func(t *testing.T) {
		t.Parallel()
		srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, "get-db.http")))
		c, _ := newTestClient(t, srv.URL)
		info, err := c.DBInfo(t.Context(), "fx_src")
		require.NoError(t, err)
		assert.Equal(t, "fx_src", info.Name)
		assert.Equal(t, "1795316723", info.InstanceStartTime)
		assert.Contains(t, info.UpdateSeq, "4-g1AAAA")
	})
	t.Run("all dbs", func(t *testing.T) {
		t.Parallel()
		srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, "all-dbs.http")))
		c, _ := newTestClient(t, srv.URL)
		dbs, err := c.AllDBs(t.Context(), "db_b", 3)
		require.NoError(t, err)
		assert.Equal(t, []string{"db_c", "fx_src", "fx_tgt"}, dbs)
		assert.Equal(t, `"db_b"`, srv.requests()[0].Query().Get("startkey"))
		assert.Equal(t, "4", srv.requests()[0].Query().Get("limit"))
	})
	t.Run("unauthorized feed", func(t *testing.T) {
		t.Parallel()
		srv := newFakeServer(t, serveBody(http.StatusUnauthorized, fixtureBody(t, "unauthorized.http")))
		c, _ := newTestClient(t, srv.URL)
		feed, err := c.NewUpdatesFeed(t.Context(), SourceDBUpdates, FeedOptions{})
		require.NoError(t, err)
		err = feed.Run(t.Context(), "", func(DBEvent) error { return nil })
		var he *HTTPError
		require.ErrorAs(t, err, &he)
		assert.Equal(t, 401, he.Status)
		assert.True(t, IsPermanent(err))
		assert.Contains(t, err.Error(), "You are not a server admin.")
		assert.Equal(t, 1, srv.count(), "a permanent error is not retried")
		require.False(t, errors.Is(err, ErrNotFound))
	})
}
