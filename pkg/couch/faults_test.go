package couch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func dbLine(db, typ, seq string) string {
	return fmt.Sprintf(`{"db_name":%q,"type":%q,"seq":%q}`, db, typ, seq)
}

// cutAfter writes lines and a partial line, then breaks the connection mid-stream.
func cutAfter(lines ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		for _, l := range lines {
			_, _ = w.Write([]byte(l + "\n"))
		}
		_, _ = w.Write([]byte(`{"db_name":"cut","ty`))
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}
}

func TestUpdatesFeedFaults(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		handlers   []http.HandlerFunc
		want       []DBEvent
		wantSince  []string // since of each request, in order
		wantBad    int64    // malformed lines
		wantLogged string
	}{
		{
			name:       "stall: a line then silence is torn down and resumed from its seq",
			handlers:   []http.HandlerFunc{serveLinesThenHang(dbLine("a", "updated", "1-x")), serveLinesThenHang(dbLine("b", "created", "2-x"))},
			want:       []DBEvent{{DB: "a", Type: "updated", Seq: "1-x"}, {DB: "b", Type: "created", Seq: "2-x"}},
			wantSince:  []string{"", "1-x"},
			wantLogged: "stalled",
		},
		{
			name:      "connection cut mid-stream resumes after the last whole line",
			handlers:  []http.HandlerFunc{cutAfter(dbLine("a", "created", "1-x"), "", dbLine("a", "updated", "2-x")), serveLinesThenHang(dbLine("c", "created", "3-x"))},
			want:      []DBEvent{{DB: "a", Type: "created", Seq: "1-x"}, {DB: "a", Type: "updated", Seq: "2-x"}, {DB: "c", Type: "created", Seq: "3-x"}},
			wantSince: []string{"", "2-x"},
		},
		{
			name: "500 then OK retries",
			handlers: []http.HandlerFunc{
				serveBody(http.StatusInternalServerError, []byte(`{"error":"internal_server_error","reason":"boom"}`)),
				serveBody(http.StatusServiceUnavailable, []byte(`oops`)),
				serveLinesThenHang(dbLine("a", "created", "1-x")),
			},
			want:       []DBEvent{{DB: "a", Type: "created", Seq: "1-x"}},
			wantSince:  []string{"", "", ""},
			wantLogged: "boom",
		},
		{
			name: "malformed lines are skipped and counted",
			handlers: []http.HandlerFunc{serveLinesThenHang(
				dbLine("a", "created", "1-x"), `{"db_name":"broken"`, `[1,2]`, `{"type":"updated"}`, `null`, `"str"`,
				dbLine("b", "ddoc_updated", "2-x"), `{"db_name":"c","type":"deleted","seq":3}`)},
			want:       []DBEvent{{DB: "a", Type: "created", Seq: "1-x"}, {DB: "b", Type: "updated", Seq: "2-x"}, {DB: "c", Type: "deleted", Seq: "3"}},
			wantSince:  []string{""},
			wantBad:    5,
			wantLogged: "malformed",
		},
		{
			name: "a last_seq line ends the stream: reconnect from it",
			handlers: []http.HandlerFunc{
				serveBody(http.StatusOK, []byte(dbLine("a", "created", "1-x")+"\n\n"+`{"last_seq":"5-x"}`+"\n")),
				serveLinesThenHang(dbLine("b", "created", "6-x")),
			},
			want:      []DBEvent{{DB: "a", Type: "created", Seq: "1-x"}, {DB: "b", Type: "created", Seq: "6-x"}},
			wantSince: []string{"", "5-x"},
		},
		{
			name: "an error line ends the connection and the feed resumes",
			handlers: []http.HandlerFunc{
				serveLinesThenHang(dbLine("a", "created", "1-x"), `{"error":"timeout","reason":"shard down"}`),
				serveLinesThenHang(dbLine("b", "created", "2-x")),
			},
			want:       []DBEvent{{DB: "a", Type: "created", Seq: "1-x"}, {DB: "b", Type: "created", Seq: "2-x"}},
			wantSince:  []string{"", "1-x"},
			wantLogged: "shard down",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, tt.handlers...)
			c, logs := newTestClient(t, srv.URL)
			feed, err := c.NewUpdatesFeed(t.Context(), SourceDBUpdates, FeedOptions{Heartbeat: 250 * time.Millisecond})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(t.Context())
			var got collector[DBEvent]
			done := runAsync(func() error { return feed.Run(ctx, "", got.emit) })
			require.Eventually(t, func() bool { return got.len() >= len(tt.want) && srv.count() >= len(tt.wantSince) },
				5*time.Second, 5*time.Millisecond)
			cancel()
			require.ErrorIs(t, waitDone(t, done), context.Canceled)
			assert.Equal(t, tt.want, got.get())
			reqs := srv.requests()
			for i, want := range tt.wantSince {
				assert.Equal(t, want, reqs[i].Query().Get("since"), "since of request %d", i)
				assert.Equal(t, "continuous", reqs[i].Query().Get("feed"))
				assert.Equal(t, "250", reqs[i].Query().Get("heartbeat"))
			}
			assert.Equal(t, tt.wantBad, c.MalformedLines())
			if tt.wantLogged != "" {
				assert.Contains(t, logs.String(), tt.wantLogged)
			}
		})
	}
}

func TestFeedPermanentErrors(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden} {
		for _, source := range []string{SourceDBUpdates, SourceGlobalChanges, SourcePoll, "changes"} {
			t.Run(fmt.Sprintf("%s %d", source, status), func(t *testing.T) {
				t.Parallel()
				srv := newFakeServer(t, serveBody(status, []byte(`{"error":"unauthorized","reason":"go away"}`)))
				c, _ := newTestClient(t, srv.URL)
				var err error
				if source == "changes" {
					err = c.FollowChanges(t.Context(), "db", ChangesOptions{}, func(Change) error { return nil })
				} else {
					feed, ferr := c.NewUpdatesFeed(t.Context(), source, FeedOptions{})
					require.NoError(t, ferr)
					err = feed.Run(t.Context(), "", func(DBEvent) error { return nil })
				}
				require.Error(t, err)
				assert.True(t, IsPermanent(err))
				assert.Equal(t, status, httpStatus(err))
				assert.Equal(t, 1, srv.count(), "no retry loop")
			})
		}
	}
}

func TestFeedReturnsEmitError(t *testing.T) {
	t.Parallel()
	stop := errors.New("stop here")
	srv := newFakeServer(t, serveLinesThenHang(`{"seq":1,"id":"a","changes":[{"rev":"1-a"}]}`, `{"seq":2,"id":"b","changes":[{"rev":"1-b"}]}`))
	c, _ := newTestClient(t, srv.URL)
	var n int
	err := c.FollowChanges(t.Context(), "db", ChangesOptions{}, func(ch Change) error {
		n++
		return stop
	})
	require.ErrorIs(t, err, stop)
	assert.Same(t, stop, err, "emit's error is returned unchanged")
	assert.Equal(t, 1, n)
}

func TestFollowChangesRequest(t *testing.T) {
	t.Parallel()
	var body atomic.Value
	srv := newFakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		b := make([]byte, r.ContentLength)
		_, _ = r.Body.Read(b)
		body.Store(r.Method + " " + string(b))
		hang(w, r)
	})
	c, _ := newTestClient(t, srv.URL)
	ctx, cancel := context.WithCancel(t.Context())
	done := runAsync(func() error {
		return c.FollowChanges(ctx, "a/b+c", ChangesOptions{Since: "7-x", DocIDs: []string{"d1"}, IncludeDocs: true,
			Conflicts: true, AllDocs: true, Heartbeat: 2 * time.Second}, func(Change) error { return nil })
	})
	require.Eventually(t, func() bool { return srv.count() >= 1 && body.Load() != nil }, 5*time.Second, 5*time.Millisecond)
	cancel()
	require.ErrorIs(t, waitDone(t, done), context.Canceled)
	r := srv.requests()[0]
	assert.Equal(t, "/a%2Fb%2Bc/_changes", r.EscapedPath())
	assert.Equal(t, map[string][]string{"feed": {"continuous"}, "since": {"7-x"}, "filter": {"_doc_ids"}, "include_docs": {"true"},
		"conflicts": {"true"}, "style": {"all_docs"}, "heartbeat": {"2000"}}, map[string][]string(r.Query()))
	assert.Equal(t, `POST {"doc_ids":["d1"]}`, body.Load())
}

func TestDBInfosFallback(t *testing.T) {
	t.Parallel()
	var inFlight, maxInFlight, posts atomic.Int64
	srv := newFakeServer(t)
	srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/_dbs_info" {
			posts.Add(1)
			serveBody(http.StatusNotFound, []byte(`{"error":"not_found","reason":"no_db_file"}`))(w, r)
			return
		}
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for {
			m := maxInFlight.Load()
			if n <= m || maxInFlight.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(2 * time.Millisecond) // lets requests overlap so the bound is exercised
		db := strings.TrimPrefix(r.URL.Path, "/")
		if strings.HasPrefix(db, "missing") {
			serveBody(http.StatusNotFound, []byte(`{"error":"not_found"}`))(w, r)
			return
		}
		serveBody(http.StatusOK, fmt.Appendf(nil, `{"db_name":%q,"update_seq":%d,"doc_count":1}`, db, len(db)))(w, r)
	})
	c, _ := newTestClient(t, srv.URL)
	var dbs []string
	for i := range 250 {
		dbs = append(dbs, fmt.Sprintf("db%03d", i))
	}
	dbs = append(dbs, "missing1")
	for range 2 {
		infos, err := c.DBInfos(t.Context(), dbs)
		require.NoError(t, err)
		assert.Len(t, infos, 250)
		assert.Equal(t, DBInfo{Name: "db007", UpdateSeq: "5", DocCount: 1}, infos["db007"])
	}
	assert.Equal(t, int64(1), posts.Load(), "a missing _dbs_info is remembered")
	assert.LessOrEqual(t, maxInFlight.Load(), int64(dbInfoConcurrency))
	assert.Greater(t, maxInFlight.Load(), int64(1), "requests run concurrently")
}

func TestEachDBPages(t *testing.T) {
	t.Parallel()
	var all []string
	for i := range 2500 {
		all = append(all, fmt.Sprintf("db%05d", i))
	}
	tests := []struct {
		name   string
		honour bool // whether the fake honours startkey and limit (PouchDB Server does not)
	}{{"server pages", true}, {"server ignores startkey and limit", false}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t)
			srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				out := all
				if tt.honour {
					out = pageOf(t, all, r)
				}
				serveBody(http.StatusOK, mustJSON(t, out))(w, r)
			})
			c, _ := newTestClient(t, srv.URL)
			var seen []string
			require.NoError(t, c.EachDB(t.Context(), func(db string) error { seen = append(seen, db); return nil }))
			assert.Equal(t, all, seen)
		})
	}
}

func TestNewValidatesURL(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{"", "ftp://admin:SECRETPW@host", "http://admin:SECRETPW@", "http://admin:SECRETPW@[::1", "http://admin:SECRETPW@h/?a=1", "admin:SECRETPW@host:5984"} {
		t.Run(raw, func(t *testing.T) {
			t.Parallel()
			_, err := New(Config{URL: raw}, nil)
			require.Error(t, err)
			assert.NotContains(t, err.Error(), "SECRETPW")
		})
	}
	_, err := New(Config{URL: "https://h", CAFile: "/nonexistent/ca.pem"}, nil)
	require.Error(t, err)
	c, err := New(Config{URL: "http://admin:SECRETPW@127.0.0.1:5999/prefix/"}, nil)
	require.NoError(t, err)
	assert.Equal(t, "http://admin:xxxxx@127.0.0.1:5999/prefix/", c.Redacted())
	assert.Equal(t, "http://admin:SECRETPW@127.0.0.1:5999/prefix", c.BaseURL().String())
	c.BaseURL().Host = "changed"
	assert.Equal(t, "127.0.0.1:5999", c.BaseURL().Host, "BaseURL returns a copy")
	tr := c.tr.(*http.Transport)
	assert.True(t, tr.DisableCompression)
	assert.Equal(t, 64, tr.MaxIdleConnsPerHost)
	assert.Zero(t, c.HTTPClient().Timeout, "feeds need a client without an overall timeout")
	assert.Equal(t, "/ab%2Bc$d%28e%29-f_g", c.DBPath("ab+c$d(e)-f_g"))
	assert.Equal(t, "/a%2Fb", c.DBPath("a/b"))
}

// pageOf answers an _all_dbs request from all as CouchDB does: startkey inclusive, then limit.
func pageOf(t *testing.T, all []string, r *http.Request) []string {
	q := r.URL.Query()
	out := all
	if sk := q.Get("startkey"); sk != "" {
		var start string
		require.NoError(t, json.Unmarshal([]byte(sk), &start))
		i := sort.SearchStrings(all, start)
		out = all[i:]
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		require.NoError(t, err)
		out = out[:min(n, len(out))]
	}
	return out
}

func mustJSON(t *testing.T, v any) []byte {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

func TestStreamFeedMatch(t *testing.T) {
	t.Parallel()
	srv := newFakeServer(t, serveLinesThenHang(`{"seq":"1-x","id":"updated:_dbs"}`, `{"seq":"2-x","id":"updated:user_a"}`, `{"seq":"3-x","id":"updated:_users"}`))
	c, _ := newTestClient(t, srv.URL)
	feed, err := c.NewUpdatesFeed(t.Context(), SourceGlobalChanges, FeedOptions{Match: func(db string) bool { return !strings.HasPrefix(db, "_") }})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var got collector[DBEvent]
	done := runAsync(func() error { return feed.Run(ctx, "", got.emit) })
	require.Eventually(t, func() bool { return got.len() == 1 }, 5*time.Second, 5*time.Millisecond)
	cancel()
	require.ErrorIs(t, waitDone(t, done), context.Canceled)
	assert.Equal(t, []DBEvent{{DB: "user_a", Type: "updated", Seq: "2-x"}}, got.get())
	assert.Equal(t, "/_global_changes/_changes", srv.requests()[0].Path)
}

func TestCredentialsSentAsBasicAuth(t *testing.T) {
	t.Parallel()
	var bad atomic.Int64
	check := func(w http.ResponseWriter, r *http.Request) bool {
		user, pw, ok := r.BasicAuth()
		if !ok || user != "admin" || pw != "p@ss:word" {
			bad.Add(1)
			serveBody(http.StatusUnauthorized, []byte(`{"error":"unauthorized"}`))(w, r)
			return false
		}
		return true
	}
	srv := newFakeServer(t,
		func(w http.ResponseWriter, r *http.Request) {
			if check(w, r) {
				serveBody(http.StatusOK, []byte(`{"db_name":"x","update_seq":1}`))(w, r)
			}
		},
		func(w http.ResponseWriter, r *http.Request) {
			if check(w, r) {
				serveLinesThenHang(`{"seq":1,"id":"a","changes":[{"rev":"1-a"}]}`)(w, r)
			}
		})
	u := strings.Replace(srv.URL, "http://", "http://admin:p%40ss%3Aword@", 1)
	c, _ := newTestClient(t, u)
	_, err := c.DBInfo(t.Context(), "x")
	require.NoError(t, err)
	stop := errors.New("got it")
	err = c.FollowChanges(t.Context(), "x", ChangesOptions{}, func(Change) error { return stop })
	require.ErrorIs(t, err, stop)
	assert.Zero(t, bad.Load())
}

func TestSinceNowFallsBackWhenNormalFeedRefused(t *testing.T) {
	t.Parallel()
	srv := newFakeServer(t,
		serveBody(http.StatusBadRequest, []byte(`{"error":"bad_request","reason":"since=now unsupported"}`)),
		serveLinesThenHang(dbLine("a", "created", "1-x")))
	c, _ := newTestClient(t, srv.URL)
	feed, err := c.NewUpdatesFeed(t.Context(), SourceDBUpdates, FeedOptions{})
	require.NoError(t, err)
	stop := errors.New("enough")
	err = feed.Run(t.Context(), SinceNow, func(DBEvent) error { return stop })
	require.ErrorIs(t, err, stop)
	reqs := srv.requests()
	require.Len(t, reqs, 2)
	assert.Equal(t, "normal", reqs[0].Query().Get("feed"))
	assert.Equal(t, "continuous", reqs[1].Query().Get("feed"))
	assert.Equal(t, SinceNow, reqs[1].Query().Get("since"))
}

// TestFeedReportsItsState: OnState hears every failure and every recovery, so that a caller
// learns of an interruption the feed rides out by itself; the permanent error that ends Run is
// reported too, and emit's own error is not the feed's.
func TestFeedReportsItsState(t *testing.T) {
	t.Parallel()
	line := `{"db_name":"a","type":"updated","seq":"1-x"}`
	for _, source := range []string{SourceDBUpdates, SourcePoll} {
		t.Run(source, func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			var states []string
			record := func(err error) {
				mu.Lock()
				defer mu.Unlock()
				if err == nil {
					states = append(states, "ok")
				} else {
					states = append(states, "error")
				}
			}
			var handlers []http.HandlerFunc
			if source == SourcePoll {
				allDBs := serveBody(http.StatusOK, []byte(`["a"]`))
				info := serveBody(http.StatusOK, []byte(`[{"key":"a","info":{"db_name":"a","update_seq":"1-x"}}]`))
				handlers = []http.HandlerFunc{serveBody(http.StatusInternalServerError, nil), allDBs, info,
					serveBody(http.StatusUnauthorized, []byte(`{"error":"unauthorized"}`))}
			} else {
				handlers = []http.HandlerFunc{serveBody(http.StatusInternalServerError, nil), serveBody(http.StatusOK, []byte(line+"\n")),
					serveBody(http.StatusUnauthorized, []byte(`{"error":"unauthorized"}`))}
			}
			srv := newFakeServer(t, handlers...)
			c, _ := newTestClient(t, srv.URL)
			feed, err := c.NewUpdatesFeed(t.Context(), source, FeedOptions{OnState: record, PollInterval: time.Millisecond})
			require.NoError(t, err)
			err = feed.Run(t.Context(), "", func(DBEvent) error { return nil })
			require.True(t, IsPermanent(err), "%v", err)
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, []string{"error", "ok", "error"}, states)
		})
	}

	t.Run("emit error", func(t *testing.T) {
		t.Parallel()
		var states []error
		srv := newFakeServer(t, serveLinesThenHang(line))
		c, _ := newTestClient(t, srv.URL)
		feed, err := c.NewUpdatesFeed(t.Context(), SourceDBUpdates, FeedOptions{OnState: func(err error) { states = append(states, err) }})
		require.NoError(t, err)
		stop := errors.New("stop")
		require.ErrorIs(t, feed.Run(t.Context(), "", func(DBEvent) error { return stop }), stop)
		assert.Equal(t, []error{nil}, states, "the connection was fine; emit's error is not a feed failure")
	})
}
