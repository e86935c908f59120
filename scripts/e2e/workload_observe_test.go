package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
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
	ready := make(chan struct{})
	var connected sync.Once
	go func() {
		since := "now"
		for ctx.Err() == nil {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet,
				cs.URL+"/"+couchtest.PathDB(db)+"/_changes?feed=continuous&heartbeat=2000&since="+since, nil)
			if err != nil {
				return
			}
			resp, err := cs.HTTP.Do(req)
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			connected.Do(func() { close(ready) })
			sc := bufio.NewScanner(resp.Body)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				var row struct {
					ID  string          `json:"id"`
					Seq json.RawMessage `json:"seq"`
				}
				if json.Unmarshal(sc.Bytes(), &row) != nil || row.ID == "" {
					continue
				}
				now := time.Now()
				a.mu.Lock()
				if _, ok := a.first[row.ID]; !ok {
					a.first[row.ID] = now
				}
				a.mu.Unlock()
				if s, err := strconv.Unquote(string(row.Seq)); err == nil {
					since = s
				} else if len(row.Seq) > 0 {
					since = string(row.Seq)
				}
			}
			resp.Body.Close()
		}
	}()
	select {
	case <-ready:
	case <-time.After(30 * time.Second):
		b.Fatalf("cannot follow the changes of %s", db)
	}
	return a
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
