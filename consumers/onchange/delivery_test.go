package main

import (
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// feed returns the doc ids of db's _changes, in feed order.
func (e *env) feed(t *testing.T, db string) []string {
	t.Helper()
	var body struct {
		Results []struct {
			ID string `json:"id"`
		} `json:"results"`
	}
	require.NoError(t, e.couch.Do(t, "GET", "/"+couchtest.PathDB(db)+"/_changes", nil, &body))
	var out []string
	for _, r := range body.Results {
		out = append(out, r.ID)
	}
	return out
}

// seqs returns each doc id's latest seq in db (opaque text).
func (e *env) seqs(t *testing.T, db string) map[string]string {
	t.Helper()
	var body struct {
		Results []struct {
			Seq json.RawMessage `json:"seq"`
			ID  string          `json:"id"`
		} `json:"results"`
	}
	require.NoError(t, e.couch.Do(t, "GET", "/"+couchtest.PathDB(db)+"/_changes", nil, &body))
	out := map[string]string{}
	for _, r := range body.Results {
		out[r.ID] = strings.Trim(string(r.Seq), `"`)
	}
	return out
}

// TestAtLeastOnce: the sink fails b twice; the checkpoint stays before b until b succeeds, and
// nothing after b is skipped.
func TestAtLeastOnce(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	e.cfg.BatchSize = 1 // a checkpoint per change, so "moves only after the 200" is observable
	app := e.start(t)
	db := e.couch.NewDB(t, e.prefix)
	for _, id := range []string{"a", "b", "c"} {
		e.couch.Put(t, db, id, map[string]any{})
	}
	seq := e.seqs(t, db)
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
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/x", "block": true, "params": map[string]any{"id": "$change.id"},
		"retry": map[string]any{"backoff": "linear", "delay_ms": 20, "limit": 5}})
	e.enqueue(t, db)
	hs := s.waitHits(t, 20*time.Second, hasID("c"), "c not delivered")
	assert.Equal(t, []string{"a", "b", "b", "b", "c"}, ids(hs))
	mu.Lock()
	// a's checkpoint is written in the background while b is first tried: at that moment it may
	// still be the empty start; it never passes a while b fails.
	require.Len(t, cpAtB, 3)
	assert.Contains(t, []string{"", seq["a"]}, cpAtB[0], "checkpoint not past a at b's first try")
	assert.Equal(t, []string{seq["a"], seq["a"]}, cpAtB[1:], "checkpoint stays at a while b fails")
	mu.Unlock()
	require.Eventually(t, func() bool { cp, _ := e.checkpoint(t, "r", db); return cp == seq["c"] }, 10*time.Second, 20*time.Millisecond)
	assert.Empty(t, e.deadLetters(t))
}

// TestRetryLimitDeadLetter: a change failing past its limit gets exactly limit+1 attempts and
// one dead-letter record; later changes are still delivered.
func TestRetryLimitDeadLetter(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.couch.NewDB(t, e.prefix)
	s := newSink(t, func(h hit, _ int) (int, time.Duration) {
		if h.param("id") == "bad" {
			return 500, 0
		}
		return 200, 0
	})
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/x", "method": "PUT", "block": true, "params": map[string]any{"id": "$change.id"},
		"retry": map[string]any{"backoff": "exponential", "delay_ms": 10, "multiplier": 2, "limit": 2}})
	for _, id := range []string{"ok1", "bad", "ok2"} {
		e.couch.Put(t, db, id, map[string]any{})
	}
	seq := e.seqs(t, db)
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, hasID("ok2"), "ok2 not delivered")
	require.Eventually(t, func() bool { cp, _ := e.checkpoint(t, "r", db); return cp == seq["ok2"] }, 10*time.Second, 20*time.Millisecond)
	assert.Equal(t, []string{"ok1", "bad", "bad", "bad", "ok2"}, ids(s.all()))
	dls := e.deadLetters(t)
	require.Len(t, dls, 1)
	d := dls[0]
	assert.Equal(t, "r", d.Rule)
	assert.Equal(t, db, d.DB)
	assert.Equal(t, "bad", d.DocID)
	assert.Equal(t, seq["bad"], d.Seq)
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
	db := e.couch.NewDB(t, e.prefix)
	e.ruleIn(t, app, "pw", db, map[string]any{"url": "http://hook@" + u.Host + "/x/${db_name}", "method": "POST",
		"retry": map[string]any{"delay_ms": 5, "limit": 1}})
	e.ruleIn(t, app, "down", db, map[string]any{"url": "http://hook@127.0.0.1:1/closed", "retry": map[string]any{"delay_ms": 5, "limit": 1}})
	e.couch.Put(t, db, "d1", map[string]any{})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return len(e.deadLetters(t)) == 2 }, 20*time.Second, 20*time.Millisecond)
	for _, h := range s.all() {
		assert.Equal(t, secret, h.Pass, "the password reaches the webhook")
	}
	assert.Len(t, s.all(), 2)
	logs := e.logs.String()
	assert.Contains(t, logs, "dead letter recorded")
	assert.NotContains(t, logs, secret)
	for _, d := range e.deadLetters(t) {
		b, _ := json.Marshal(d)
		assert.NotContains(t, string(b), secret)
	}
}

// TestSubjectRule: a plain JetStream consumer reads every change of the db in feed order;
// replaying (checkpoint deleted) adds no duplicates; a subject no stream captures makes only
// that rule fail, with a dead letter naming it.
func TestSubjectRule(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.couch.NewDB(t, e.prefix)
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	e.ruleIn(t, app, "nostream", db, map[string]any{"subject": "nowhere.${db_name}"})
	var want []string
	for i := range 10 {
		id := fmt.Sprintf("d%d", i%4)
		var rev string
		for _, w := range want {
			if strings.HasPrefix(w, id+"/") {
				rev = strings.TrimPrefix(w, id+"/")
			}
		}
		doc := map[string]any{"i": i}
		if rev != "" {
			doc["_rev"] = rev
		}
		want = append(want, id+"/"+e.couch.Put(t, db, id, doc))
	}
	e.enqueue(t, db)
	stream, err := e.js.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	msgs := func() uint64 { info, err := stream.Info(t.Context()); require.NoError(t, err); return info.State.Msgs }
	// CouchDB's feed lists each doc once, at its latest change.
	require.Eventually(t, func() bool { return msgs() == 4 }, 20*time.Second, 20*time.Millisecond)
	feed := e.feed(t, db)
	require.Eventually(t, func() bool { cp, _ := e.checkpoint(t, "pub", db); return cp != "" }, 10*time.Second, 20*time.Millisecond)

	cons, err := stream.OrderedConsumer(t.Context(), jetstream.OrderedConsumerConfig{FilterSubjects: []string{"spiegel.changes.>"}})
	require.NoError(t, err)
	var got []changeMessage
	for range 4 {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		require.NoError(t, err)
		var c changeMessage
		require.NoError(t, json.Unmarshal(m.Data(), &c))
		assert.Equal(t, db+"/"+c.ID+"/"+c.Changes[0].Rev, m.Headers().Get(jetstream.MsgIDHeader))
		got = append(got, c)
	}
	var gotIDs []string
	for _, c := range got {
		gotIDs = append(gotIDs, c.ID)
	}
	assert.Equal(t, feed, gotIDs, "feed order")
	assert.Equal(t, db, got[0].DB)
	assert.NotEmpty(t, got[0].Doc)

	// Replay: delete the checkpoint and run again: the stream deduplicates every change.
	var cp map[string]any
	id := url.PathEscape(checkpoint.ID("pub", db))
	require.NoError(t, e.couch.Do(t, "GET", "/"+couchtest.PathDB(e.cfg.DBName)+"/"+id, nil, &cp))
	require.NoError(t, e.couch.Do(t, "DELETE", "/"+couchtest.PathDB(e.cfg.DBName)+"/"+id+"?rev="+cp["_rev"].(string), nil, nil))
	e.enqueue(t, db)
	require.Eventually(t, func() bool { _, ok := e.checkpoint(t, "pub", db); return ok }, 20*time.Second, 20*time.Millisecond)
	assert.EqualValues(t, 4, msgs(), "replay added no duplicates")

	dls := e.deadLetters(t)
	require.Len(t, dls, 1, "one dead letter for the unusable rule")
	assert.Equal(t, "nostream", dls[0].Rule)
	assert.Contains(t, dls[0].Error, "no stream captures subject nowhere.")
	_, ok := e.checkpoint(t, "nostream", db)
	assert.False(t, ok, "the unusable rule did not move")
}

// TestRuleEditedMidRun: an edit applies from the next batch, without losing or skipping changes.
func TestRuleEditedMidRun(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	e.cfg.BatchSize = 1
	app := e.start(t)
	db := e.couch.NewDB(t, e.prefix)
	s := newSink(t, func(hit, int) (int, time.Duration) { return 200, 50 * time.Millisecond })
	rule := map[string]any{"url": s.URL + "/v1", "block": true, "params": map[string]any{"id": "$change.id", "db": "$db_name"}}
	e.ruleIn(t, app, "r", db, rule)
	const n = 20
	for i := range n {
		e.couch.Put(t, db, fmt.Sprintf("d%02d", i), map[string]any{})
	}
	e.enqueue(t, db)
	s.waitHits(t, 20*time.Second, func(hs []hit) bool { return len(hs) >= 2 }, "first requests")
	var cur map[string]any
	require.NoError(t, e.couch.Do(t, "GET", "/"+couchtest.PathDB(e.cfg.DBName)+"/r", nil, &cur))
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
