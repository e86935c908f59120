package main

import (
	"encoding/json"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/webhook"
)

// only matches exactly db.
func only(db string) string { return "^" + regexp.QuoteMeta(db) + "$" }

// ids returns the doc id each hit carries (param "id").
func ids(hs []hit) []string {
	out := make([]string, 0, len(hs))
	for _, h := range hs {
		out = append(out, h.param("id"))
	}
	return out
}

func hasID(id string) func([]hit) bool {
	return func(hs []hit) bool { return slices.Contains(ids(hs), id) }
}

// ruleIn writes rule id for db and waits until app has it.
func (e *env) ruleIn(t *testing.T, app *consumer.App, id, db string, doc map[string]any) {
	doc["db_name"] = only(db)
	waitRule(t, id, e.putRule(t, id, doc), app)
}

// TestSpiegelBehaviours covers the on_change behaviours of the original Spiegel against a real
// PouchDB/CouchDB, embedded NATS and a real local HTTP sink.
func TestSpiegelBehaviours(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	fast := map[string]any{"backoff": "linear", "delay_ms": 10, "limit": 1}

	t.Run("GET with query params", func(t *testing.T) {
		s := newSink(t, nil)
		db := e.Couch.NewDB(t, e.Prefix)
		e.ruleIn(t, app, "get_"+db, db, map[string]any{"url": s.URL + "/get/${db_name}",
			"params": map[string]any{"id": "$change.id", "db": "$db_name", "num": 7, "nested": map[string]any{"a": []any{1, "x y"}}}})
		e.Couch.Put(t, db, "d1", map[string]any{"n": 5})
		e.enqueue(t, db)
		h := s.waitHits(t, 20*time.Second, hasID("d1"), "no GET for d1")[0]
		assert.Equal(t, "GET", h.Method)
		assert.Equal(t, "/get/"+url.PathEscape(db), h.Path)
		q, err := url.ParseQuery(h.Query)
		require.NoError(t, err)
		assert.Equal(t, url.Values{"id": {"d1"}, "db": {db}, "num": {"7"}, "nested[a][0]": {"1"}, "nested[a][1]": {"x y"}}, q)
	})

	t.Run("POST with JSON body, URL template, $change as object, numbers", func(t *testing.T) {
		s := newSink(t, nil)
		db := e.Couch.NewDB(t, e.Prefix)
		e.ruleIn(t, app, "post_"+db, db, map[string]any{"url": s.URL + "/post/${db_name}/${change.id}", "method": "POST",
			"params": map[string]any{"id": "$change.id", "change": "$change", "doc": "$change.doc", "num": 3.25, "big": json.Number("9007199254740991"), "seq": "$seq"}})
		e.Couch.Put(t, db, "d+1", map[string]any{"v": json.Number("1234567890123"), "s": "x"})
		e.enqueue(t, db)
		h := s.waitHits(t, 20*time.Second, hasID("d+1"), "no POST for d+1")[0]
		assert.Equal(t, "POST", h.Method)
		assert.Equal(t, "/post/"+url.PathEscape(db)+"/d%2B1", h.Path)
		assert.Equal(t, "application/json", h.Header.Get("Content-Type"))
		assert.Equal(t, webhook.InstanceName(), h.Header.Get(webhook.InstanceHeader), "the call names the instance that made it")
		change, ok := h.Body["change"].(map[string]any)
		require.True(t, ok, "$change is an object: %v", h.Body["change"])
		assert.Equal(t, "d+1", change["id"])
		doc, ok := change["doc"].(map[string]any)
		require.True(t, ok, "$change.doc is an object")
		assert.Equal(t, json.Number("1234567890123"), doc["v"])
		assert.Equal(t, doc, h.Body["doc"])
		assert.Equal(t, json.Number("3.25"), h.Body["num"])
		assert.Equal(t, json.Number("9007199254740991"), h.Body["big"])
		assert.NotEmpty(t, h.Body["seq"])
	})

	t.Run("if with regex and null", func(t *testing.T) {
		s := newSink(t, nil)
		db := e.Couch.NewOneShardDB(t, e.Prefix) // one feed order: zz_end is the last change
		e.ruleIn(t, app, "if_"+db, db, map[string]any{"url": s.URL + "/if", "block": true, "params": map[string]any{"id": "$change.id"},
			"if": map[string]any{"type": "^post$", "archived": nil}})
		for _, d := range []struct {
			id  string
			doc map[string]any
		}{
			{"p1", map[string]any{"type": "post"}},
			{"p2", map[string]any{"type": "post", "archived": true}},
			{"p3", map[string]any{"type": "comment"}},
			{"p4", map[string]any{"type": "repost"}},
			{"p5", map[string]any{"type": "post", "archived": nil}},
			{"p6", map[string]any{"kind": "post"}},
			{"zz_end", map[string]any{"type": "post"}},
		} {
			e.Couch.Put(t, db, d.id, d.doc)
		}
		e.enqueue(t, db)
		hs := s.waitHits(t, 20*time.Second, hasID("zz_end"), "end marker not delivered")
		assert.Equal(t, []string{"p1", "p5", "zz_end"}, ids(hs))
	})

	t.Run("2xx 3xx 4xx 5xx", func(t *testing.T) {
		s := newSink(t, func(h hit, _ int) (int, time.Duration) {
			if h.Path == "/redirected" {
				return 200, 0
			}
			st := 200
			_, _ = fmt.Sscanf(strings.TrimPrefix(h.Path, "/s/"), "%d", &st)
			return st, 0
		})
		db := e.Couch.NewDB(t, e.Prefix)
		statuses := []int{200, 201, 204, 302, 404, 400, 500, 503}
		for _, method := range []string{"POST", "GET"} {
			id := strings.ToLower(method) + "_" + db
			// The GET rule follows redirects (follow_redirects), the POST rule does not (the default).
			e.ruleIn(t, app, id, db, map[string]any{"url": s.URL + "/s/${change.id}", "method": method, "block": true, "retry": fast,
				"follow_redirects": method == "GET"})
		}
		for _, st := range statuses {
			e.Couch.Put(t, db, fmt.Sprint(st), map[string]any{})
		}
		e.enqueue(t, db)
		count := func(hs []hit, method string, st int) int {
			n := 0
			for _, h := range hs {
				if h.Method == method && h.Path == fmt.Sprintf("/s/%d", st) {
					n++
				}
			}
			return n
		}
		s.waitHits(t, 20*time.Second, func(hs []hit) bool { return count(hs, "POST", 503) == 2 && count(hs, "GET", 503) == 2 }, "503s not retried to the limit")
		require.Eventually(t, func() bool { return len(e.deadLettersOf(t, db)) == 9 }, 10*time.Second, 20*time.Millisecond)
		hs := s.all()
		for _, st := range statuses {
			wantPost, wantGet := 1, 1
			if st >= 300 {
				wantPost = 2 // failure: first attempt and one retry, then dead letter
			}
			if st >= 400 {
				wantGet = 2 // the GET rule follows the redirect: 302 is a success
			}
			assert.Equal(t, wantPost, count(hs, "POST", st), "POST %d", st)
			assert.Equal(t, wantGet, count(hs, "GET", st), "GET %d", st)
		}
		var got []string
		for _, d := range e.deadLettersOf(t, db) {
			got = append(got, fmt.Sprintf("%s %s %d %d", strings.SplitN(d.Rule, "_", 2)[0], d.DocID, d.Status, d.Attempts))
		}
		assert.ElementsMatch(t, []string{"get 404 404 2", "get 400 400 2", "get 500 500 2", "get 503 503 2",
			"post 302 302 2", "post 404 404 2", "post 400 400 2", "post 500 500 2", "post 503 503 2"}, got)
	})

	t.Run("debounce collapses identical requests of a batch", func(t *testing.T) {
		s := newSink(t, nil)
		db := e.Couch.NewDB(t, e.Prefix)
		e.ruleIn(t, app, "deb_"+db, db, map[string]any{"url": s.URL + "/deb/${db_name}", "method": "POST", "debounce": true,
			"params": map[string]any{"db": "$db_name"}})
		e.ruleIn(t, app, "all_"+db, db, map[string]any{"url": s.URL + "/all", "method": "POST", "params": map[string]any{"id": "$change.id"}})
		for i := range 5 {
			e.Couch.Put(t, db, fmt.Sprintf("d%d", i), map[string]any{})
		}
		e.enqueue(t, db)
		s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) >= 6 }, "not every request sent")
		require.Eventually(t, func() bool { _, ok := e.checkpoint(t, "deb_"+db, db); return ok }, 10*time.Second, 20*time.Millisecond)
		deb := 0
		for _, h := range s.all() {
			if strings.HasPrefix(h.Path, "/deb/") {
				deb++
			}
		}
		assert.Equal(t, 1, deb, "five identical requests sent once")
		assert.Len(t, s.all(), 6)
	})

	t.Run("block: a, b, c never overlap and arrive in feed order", func(t *testing.T) {
		s := newSink(t, func(hit, int) (int, time.Duration) { return 200, 30 * time.Millisecond })
		db := e.Couch.NewOneShardDB(t, e.Prefix) // its feed is in write order
		e.ruleIn(t, app, "blk_"+db, db, map[string]any{"url": s.URL + "/b", "block": true, "params": map[string]any{"id": "$change.id"}})
		for _, id := range []string{"c", "a", "b"} { // feed order differs from id order
			e.Couch.Put(t, db, id, map[string]any{})
		}
		e.enqueue(t, db)
		hs := s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) == 3 }, "three requests")
		assert.Equal(t, []string{"c", "a", "b"}, ids(hs))
		for i := 1; i < len(hs); i++ {
			assert.False(t, hs[i].Start.Before(hs[i-1].End), "request %d started before %d ended", i, i-1)
		}
	})

	t.Run("no block: bounded concurrency", func(t *testing.T) {
		var inFlight, peak atomic.Int64
		s := newSink(t, func(hit, int) (int, time.Duration) {
			n := inFlight.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			// Out of the count before the answer leaves, so a request counted here has not been
			// answered: no timer that a loaded machine could fire late.
			time.Sleep(50 * time.Millisecond)
			inFlight.Add(-1)
			return 200, 0
		})
		db := e.Couch.NewDB(t, e.Prefix)
		e.ruleIn(t, app, "nb_"+db, db, map[string]any{"url": s.URL + "/nb", "params": map[string]any{"id": "$change.id"}})
		for i := range 40 {
			e.Couch.Put(t, db, fmt.Sprintf("d%02d", i), map[string]any{})
		}
		e.enqueue(t, db)
		hs := s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) >= 40 }, "40 requests")
		assert.Len(t, hs, 40)
		assert.Greater(t, peak.Load(), int64(1), "requests ran concurrently")
		assert.LessOrEqual(t, peak.Load(), int64(e.cfg.RequestConcurrency), "at most SPIEGEL_REQUEST_CONCURRENCY at once")
	})

	t.Run("missing db is acked without retry", func(t *testing.T) {
		db := e.Prefix + "never_created"
		e.ruleIn(t, app, "miss_"+db, db, map[string]any{"url": "http://127.0.0.1:1/x"})
		e.enqueue(t, db)
		require.Eventually(t, func() bool { return strings.Contains(e.Logs.String(), "db does not exist") }, 10*time.Second, 20*time.Millisecond)
		// Jobs of the other cases may still be pending: only this db's must be gone.
		subject := events.NewSubjects("").Work(events.GroupOnChange, db)
		require.Eventually(t, func() bool { return e.Pending(t)[subject] == 0 }, 10*time.Second, 20*time.Millisecond)
	})
}
