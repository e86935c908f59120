package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// latencySink is the webhook: it records when each doc id was first called for.
type latencySink struct {
	*httptest.Server
	mu    sync.Mutex
	first map[string]time.Time
}

func newLatencySink(b testing.TB) *latencySink {
	s := &latencySink{first: map[string]time.Time{}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		id := r.URL.Query().Get("id")
		s.mu.Lock()
		if _, ok := s.first[id]; !ok {
			s.first[id] = now
		}
		s.mu.Unlock()
	}))
	b.Cleanup(s.Close)
	return s
}

func (s *latencySink) snapshot() map[string]time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]time.Time, len(s.first))
	for k, v := range s.first {
		out[k] = v
	}
	return out
}

func (s *latencySink) distinct() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.first)
}

// arrivals records when each doc id first appeared on a db's continuous _changes feed.
type arrivals struct {
	mu    sync.Mutex
	first map[string]time.Time
}

func (a *arrivals) snapshot() map[string]time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]time.Time, len(a.first))
	for k, v := range a.first {
		out[k] = v
	}
	return out
}

// watchArrivals follows db's changes from now, straight from the server, until ctx ends.
func watchArrivals(ctx context.Context, b testing.TB, cs *couchtest.Server, db string) *arrivals {
	a := &arrivals{first: map[string]time.Time{}}
	follow(ctx, b, cs, "/"+couchtest.PathDB(db)+"/_changes", "the changes of "+db, func(line []byte, at time.Time) json.RawMessage {
		var row struct {
			ID  string          `json:"id"`
			Seq json.RawMessage `json:"seq"`
		}
		if json.Unmarshal(line, &row) != nil || row.ID == "" {
			return nil
		}
		a.mu.Lock()
		if _, ok := a.first[row.ID]; !ok {
			a.first[row.ID] = at
		}
		a.mu.Unlock()
		return row.Seq
	})
	return a
}

// dbUpdates records when the server's _db_updates feed named each db.
type dbUpdates struct {
	mu   sync.Mutex
	seen map[string][]time.Time // by db, in the order read
}

// after returns the first time the feed named db at or after t.
func (u *dbUpdates) after(db string, t time.Time) (time.Time, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, at := range u.seen[db] {
		if !at.Before(t) {
			return at, true
		}
	}
	return time.Time{}, false
}

// watchDBUpdates follows srv's _db_updates feed from now until ctx ends: the feed the producer
// follows (on PouchDB Server, the test proxy's), read the same way.
func watchDBUpdates(ctx context.Context, b testing.TB, srv *couchtest.Server) *dbUpdates {
	u := &dbUpdates{seen: map[string][]time.Time{}}
	follow(ctx, b, srv, "/_db_updates", "_db_updates", func(line []byte, at time.Time) json.RawMessage {
		var row struct {
			DB  string          `json:"db_name"`
			Seq json.RawMessage `json:"seq"`
		}
		if json.Unmarshal(line, &row) != nil || row.DB == "" {
			return nil
		}
		u.mu.Lock()
		u.seen[row.DB] = append(u.seen[row.DB], at)
		u.mu.Unlock()
		return row.Seq
	})
	return u
}

// follow reads the continuous feed at path (what names it in a failure) from now until ctx
// ends, coming back from the last seq after a dropped connection. row gets each line and when
// it was read, and returns the line's seq (nil: not a row). follow returns once the feed answered.
func follow(ctx context.Context, b testing.TB, srv *couchtest.Server, path, what string, row func(line []byte, at time.Time) json.RawMessage) {
	ready := make(chan struct{})
	var connected sync.Once
	go func() {
		since := "now"
		for ctx.Err() == nil {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path+"?feed=continuous&heartbeat=2000&since="+url.QueryEscape(since), nil)
			if err != nil {
				return
			}
			resp, err := srv.HTTP.Do(req)
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			connected.Do(func() { close(ready) })
			sc := bufio.NewScanner(resp.Body)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				seq := row(sc.Bytes(), time.Now())
				if s, err := strconv.Unquote(string(seq)); err == nil {
					since = s
				} else if len(seq) > 0 {
					since = string(seq)
				}
			}
			resp.Body.Close()
		}
	}()
	select {
	case <-ready:
	case <-time.After(30 * time.Second):
		b.Fatalf("cannot follow %s", what)
	}
}

func docCount(b testing.TB, cs *couchtest.Server, db string) int {
	var info struct {
		DocCount int `json:"doc_count"`
	}
	if err := cs.Do(b, http.MethodGet, "/"+couchtest.PathDB(db), nil, &info); err != nil {
		return 0
	}
	return info.DocCount
}
