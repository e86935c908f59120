package main

import (
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// TestAtLeastOnce: the sink fails b twice; b is retried in place (block), the checkpoint never
// passes b while it fails, nothing after b is skipped, and delivery follows the feed.
func TestAtLeastOnce(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	e.cfg.BatchSize = 1 // a checkpoint per change, so "never past b while b fails" is observable
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	for _, id := range []string{"a", "b", "c"} {
		e.Couch.Put(t, db, id, map[string]any{})
	}
	var mu sync.Mutex
	var cpAtB []string
	bTries := 0
	s := newSink(t, func(h hit, _ int) (int, time.Duration) {
		if h.param("id") != "b" {
			return 200, 0
		}
		cp, _ := e.checkpoint(t, "r", db)
		mu.Lock()
		defer mu.Unlock()
		cpAtB = append(cpAtB, cp)
		if bTries++; bTries <= 2 {
			return 500, 0
		}
		return 200, 0
	})
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/x", "block": true, "params": map[string]any{"id": "$change.id", "seq": "$seq"},
		"retry": map[string]any{"backoff": "linear", "delay_ms": 20, "limit": 5}})
	e.enqueue(t, db)
	hs := s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) >= 5 }, "not every change delivered")
	got := ids(hs)
	assert.Equal(t, map[string]int{"a": 1, "b": 3, "c": 1}, count(got))
	first := slices.Index(got, "b")
	assert.Equal(t, []string{"b", "b", "b"}, got[first:first+3], "b is retried before anything after it")
	requireFeedOrder(t, seqParams(hs), "delivery in feed order")

	// What came before b in the feed is done; b never is while it fails.
	before := map[string]bool{"": true}
	for _, h := range hs[:first] {
		before[h.param("seq")] = true
	}
	mu.Lock()
	require.Len(t, cpAtB, 3)
	for i, cp := range cpAtB {
		assert.True(t, before[cp], "try %d of b: checkpoint %q is not a position before b", i+1, cp)
		assert.Contains(t, e.changesSince(t, db, cp), "b", "try %d of b: the checkpoint passed b", i+1)
	}
	mu.Unlock()
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 10*time.Second, 20*time.Millisecond, "the checkpoint reaches the end")
	assert.Empty(t, e.DeadLetters(t))
}

// TestRetryLimitDeadLetter: a change failing past its limit gets exactly limit+1 attempts and
// one dead-letter record; later changes are still delivered.
func TestRetryLimitDeadLetter(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	s := newSink(t, func(h hit, _ int) (int, time.Duration) {
		if h.param("id") == "bad" {
			return 500, 0
		}
		return 200, 0
	})
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/x", "method": "PUT", "block": true, "params": map[string]any{"id": "$change.id", "seq": "$seq"},
		"retry": map[string]any{"backoff": "exponential", "delay_ms": 10, "multiplier": 2, "limit": 2}})
	for _, id := range []string{"ok1", "bad", "ok2"} {
		e.Couch.Put(t, db, id, map[string]any{})
	}
	e.enqueue(t, db)
	hs := s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) >= 5 }, "not every change tried")
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 10*time.Second, 20*time.Millisecond, "the checkpoint moves past the dead letter")
	got := ids(hs)
	assert.Equal(t, map[string]int{"ok1": 1, "bad": 3, "ok2": 1}, count(got))
	first := slices.Index(got, "bad")
	assert.Equal(t, []string{"bad", "bad", "bad"}, got[first:first+3])
	requireFeedOrder(t, seqParams(hs), "delivery in feed order")
	dls := e.DeadLetters(t)
	require.Len(t, dls, 1)
	d := dls[0]
	assert.Equal(t, "r", d.Rule)
	assert.Equal(t, db, d.DB)
	assert.Equal(t, "bad", d.DocID)
	assert.Equal(t, hs[first].param("seq"), d.Seq, "the record names the change's seq")
	var after struct {
		Results []struct{ ID string } `json:"results"`
	}
	require.NoError(t, e.Couch.Do(t, "GET", "/"+url.PathEscape(db)+"/_changes?since="+url.QueryEscape(d.Since), nil, &after))
	var resumed []string
	for _, r := range after.Results {
		resumed = append(resumed, r.ID)
	}
	// A sharded db (CouchDB, q > 1) may list again a change before since; what counts is that a
	// re-drive from since does not skip the dead-lettered one.
	assert.Contains(t, resumed, "bad", "the record's since is before its change: a re-drive resumes there")
	assert.Equal(t, 500, d.Status)
	assert.Equal(t, 3, d.Attempts)
	assert.Contains(t, d.Error, "500")
}

// TestPasswordsNeverLogged: the password is injected into the request, and neither logs nor
// dead-letter records ever hold it, whatever fails.
func TestPasswordsNeverLogged(t *testing.T) {
	const secret = "Very-S3cret-p4ss"
	e := newEnv(t, 60*time.Second)
	s := newSink(t, func(h hit, _ int) (int, time.Duration) { return 500, 0 })
	u, _ := url.Parse(s.URL)
	file := filepath.Join(t.TempDir(), "passwords.json")
	require.NoError(t, os.WriteFile(file, []byte(fmt.Sprintf(`{"127.0.0.1": {"hook": %q}}`, secret)), 0o600))
	e.cfg.PasswordsFile = file
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "pw", db, map[string]any{"url": "http://hook@" + u.Host + "/x/${db_name}", "method": "POST",
		"retry": map[string]any{"delay_ms": 5, "limit": 1}})
	e.ruleIn(t, app, "down", db, map[string]any{"url": "http://hook@127.0.0.1:1/closed", "retry": map[string]any{"delay_ms": 5, "limit": 1}})
	e.Couch.Put(t, db, "d1", map[string]any{})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return len(e.DeadLetters(t)) == 2 }, 20*time.Second, 20*time.Millisecond)
	for _, h := range s.all() {
		assert.Equal(t, secret, h.Pass, "the password reaches the webhook")
	}
	assert.Len(t, s.all(), 2)
	// The log line follows the record's publish: wait for both lines.
	require.Eventually(t, func() bool { return strings.Count(e.Logs.String(), "dead letter recorded") == 2 }, 10*time.Second, 20*time.Millisecond)
	logs := e.Logs.String()
	assert.NotContains(t, logs, secret)
	for _, d := range e.DeadLetters(t) {
		b, _ := json.Marshal(d)
		assert.NotContains(t, string(b), secret)
	}
}

// TestSubjectRule: a plain JetStream consumer reads every change of the db in feed order,
// with block unset and the default concurrency settings (500 changes, so that any reordering
// shows); replaying (checkpoint deleted) adds no duplicates; a subject no stream captures makes
// only that rule fail, with a dead letter naming it.
func TestSubjectRule(t *testing.T) {
	const docs, changes = 400, 520
	e := newEnv(t, 60*time.Second)
	var defaults config.OnChange // the concurrency settings at their defaults
	t.Setenv("SPIEGEL_COUCHDB_URL", e.Couch.URL)
	require.NoError(t, config.Load(&defaults))
	e.cfg.BatchSize, e.cfg.RequestConcurrency = defaults.BatchSize, defaults.RequestConcurrency
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	e.ruleIn(t, app, "nostream", db, map[string]any{"subject": "nowhere.${db_name}"})
	revs := e.writeChanges(t, db, docs, changes)
	e.enqueue(t, db)
	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	msgs := func() uint64 { info, err := stream.Info(t.Context()); require.NoError(t, err); return info.State.Msgs }
	// The feed lists each doc once, at its latest change.
	require.Eventually(t, func() bool { return msgs() == docs }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return e.caughtUp(t, "pub", db) }, 10*time.Second, 20*time.Millisecond)

	cons, err := stream.OrderedConsumer(t.Context(), jetstream.OrderedConsumerConfig{FilterSubjects: []string{"spiegel.changes.>"}})
	require.NoError(t, err)
	var seqs []string
	seen := map[string]bool{}
	for range docs {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		require.NoError(t, err)
		var c changeMessage
		require.NoError(t, json.Unmarshal(m.Data(), &c))
		require.Equal(t, db, c.DB)
		require.NotEmpty(t, c.Doc)
		assert.Equal(t, db+"/"+c.ID+"/"+c.Changes[0].Rev, m.Headers().Get(jetstream.MsgIDHeader))
		assert.Equal(t, revs[c.ID], c.Changes[0].Rev, "the doc's latest rev")
		seen[c.ID] = true
		seqs = append(seqs, c.Seq)
	}
	assert.Len(t, seen, docs, "every doc once")
	requireFeedOrder(t, seqs, "the stream holds the changes in feed order")

	// Replay: reset the checkpoint and run again: every change is published again, and the
	// stream deduplicates every one.
	published := func() float64 { return testutil.ToFloat64(app.Metrics.ChangesPublished) }
	require.Equal(t, float64(docs), published())
	e.replay(t, "pub", db)
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return published() == 2*docs && e.caughtUp(t, "pub", db) }, 20*time.Second, 20*time.Millisecond)
	assert.EqualValues(t, docs, msgs(), "replay added no duplicates")

	dls := e.DeadLetters(t)
	require.Len(t, dls, 1, "one dead letter for the unusable rule")
	assert.Equal(t, "nostream", dls[0].Rule)
	assert.Contains(t, dls[0].Error, "no stream captures subject nowhere.")
	seq, _ := e.checkpoint(t, "nostream", db)
	assert.Empty(t, seq, "the unusable rule did not move")
}

// writeChanges makes n changes to docs d000..d<docs-1> of db (updates after the first round) in
// _bulk_docs requests of 100 and returns each doc's final rev.
func (e *env) writeChanges(t testing.TB, db string, docs, n int) map[string]string {
	t.Helper()
	revs := map[string]string{}
	for done := 0; done < n; {
		var batch []map[string]any
		for ; done < n && len(batch) < 100; done++ {
			id := fmt.Sprintf("d%03d", done%docs)
			doc := map[string]any{"_id": id, "i": done}
			if r, ok := revs[id]; ok {
				doc["_rev"] = r
			}
			batch = append(batch, doc)
			if _, again := revs[id]; !again {
				revs[id] = ""
			}
		}
		// A doc updated twice in one batch would conflict: batches of 100 never repeat an id
		// while docs >= 100.
		var res []struct {
			ID    string `json:"id"`
			Rev   string `json:"rev"`
			Error string `json:"error"`
		}
		require.NoError(t, e.Couch.Do(t, "POST", "/"+couchtest.PathDB(db)+"/_bulk_docs", map[string]any{"docs": batch}, &res))
		for _, r := range res {
			require.Empty(t, r.Error, r.ID)
			revs[r.ID] = r.Rev
		}
	}
	return revs
}

// TestRuleEditedMidRun: an edit applies from the next batch, without losing or skipping changes.
func TestRuleEditedMidRun(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	e.cfg.BatchSize = 1
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	s := newSink(t, func(hit, int) (int, time.Duration) { return 200, 50 * time.Millisecond })
	rule := map[string]any{"url": s.URL + "/v1", "block": true, "params": map[string]any{"id": "$change.id", "db": "$db_name"}}
	e.ruleIn(t, app, "r", db, rule)
	const n = 20
	for i := range n {
		e.Couch.Put(t, db, fmt.Sprintf("d%02d", i), map[string]any{})
	}
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) >= 2 }, "first requests")
	var cur map[string]any
	require.NoError(t, e.Couch.Do(t, "GET", "/"+couchtest.PathDB(e.cfg.DBName)+"/r", nil, &cur))
	rule["url"], rule["_rev"] = s.URL+"/v2", cur["_rev"]
	e.ruleIn(t, app, "r", db, rule)
	hs := s.waitHits(t, 30*time.Second, func(hs []hit) bool { return len(delivered(hs)[db]) == n }, "every change delivered")
	assert.Equal(t, "/v1", hs[0].Path)
	assert.Equal(t, "/v2", hs[len(hs)-1].Path, "the edit took effect")
	for i := 1; i < len(hs); i++ {
		if hs[i-1].Path == "/v2" {
			assert.Equal(t, "/v2", hs[i].Path, "never back to the old version")
		}
	}
}
