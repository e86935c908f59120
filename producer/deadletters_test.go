package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

func TestParseAge(t *testing.T) {
	for in, want := range map[string]time.Duration{"": 0, "90m": 90 * time.Minute, "24h": 24 * time.Hour, "7d": 7 * 24 * time.Hour} {
		got, err := parseAge(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"yesterday", "-1h", "0s", "0d", "xd", "1.5d"} {
		_, err := parseAge(in)
		assert.Error(t, err, in)
	}
}

// PlanRedrives decides per (group, rule, db) what retry does, and the question retry asks says so.
func TestPlanRedrives(t *testing.T) {
	set := rules.NewSet()
	for id, doc := range map[string]string{
		"hook":  `{"type":"on_change","db_name":"^user","url":"http://hooks.example/x"}`,
		"off":   `{"type":"on_change","db_name":"^user","url":"http://hooks.example/x","disabled":true}`,
		"copy":  `{"type":"replicator","db_name":"^user","source":"$db_name","target":"http://t.example/c_$db_name"}`,
		"other": `{"type":"on_change","db_name":"^team","url":"http://hooks.example/x"}`,
	} {
		_, err := set.Apply(id, []byte(doc), false)
		require.NoError(t, err, id)
	}
	rec := func(id uint64, g events.Group, rule, db, seq, since string) admin.Record {
		return admin.Record{ID: id, DeadLetter: worker.DeadLetter{Group: g, Rule: rule, DB: db, Seq: seq, Since: since}}
	}
	// newest first, as read
	recs := []admin.Record{
		rec(9, events.GroupOnChange, "hook", "user1", "15-x", "14-x"),
		rec(8, events.GroupOnChange, "hook", "user1", "5-x", "4-x"),
		rec(7, events.GroupReplicate, "copy", "user1", "", ""),
		rec(6, events.GroupOnChange, "hook", "user2", "8", ""),
		rec(5, events.GroupOnChange, "off", "user1", "3", "2"),
		rec(4, events.GroupOnChange, "gone", "user1", "3", "2"),
		rec(3, events.GroupOnChange, "other", "user1", "3", "2"),
		rec(2, events.GroupReplicate, "hook", "user3", "", ""),
		rec(1, events.GroupOnChange, "hook", "user4", "", ""),
	}
	plans := admin.PlanRedrives(recs, set)
	got := map[string]*admin.Redrive{}
	for _, p := range plans {
		got[string(p.Group)+"/"+p.Rule+"/"+p.DB] = p
	}
	require.Len(t, got, 8)
	p := got["onchange/hook/user1"]
	assert.Equal(t, "4-x", p.Since, "the earliest resume point")
	assert.Empty(t, p.Skip)
	assert.Equal(t, []uint64{8, 9}, []uint64{p.Recs[0].ID, p.Recs[1].ID}, "oldest first")
	assert.Empty(t, got["replicate/copy/user1"].Skip)
	assert.Empty(t, got["replicate/copy/user1"].Since)
	assert.Contains(t, got["onchange/hook/user2"].Skip, "without a resume point: use producer replay --rule hook --db '^user2$' --since")
	assert.Contains(t, got["onchange/off/user1"].Skip, `rule "off" no longer exists, is invalid or is disabled`)
	assert.Contains(t, got["onchange/gone/user1"].Skip, `rule "gone" no longer exists`)
	assert.Contains(t, got["onchange/other/user1"].Skip, "no longer matches the db")
	assert.Contains(t, got["replicate/hook/user3"].Skip, `rule "hook" is now of kind on_change`)
	assert.Empty(t, got["onchange/hook/user4"].Skip, "a record without a seq (unusable subject) only enqueues")
	assert.Empty(t, got["onchange/hook/user4"].Since)
	assert.True(t, strings.HasPrefix(describePlans(plans), "This re-drives 4 dead letters and deletes them:"))
}

// `deadletters list` reads the stream backwards a span at a time: every filter and page gives
// the records it gave when the whole stream was read, newest first, across spans.
func TestDeadLettersListPages(t *testing.T) {
	e := newEnv(t)
	subj := events.NewSubjects("")
	const n = 2*admin.DeadLetterSpan + 150
	var futures []jetstream.PubAckFuture
	for i := 1; i <= n; i++ {
		g := events.GroupReplicate
		if i%3 == 0 {
			g = events.GroupOnChange
		}
		data, err := json.Marshal(worker.DeadLetter{Group: g, DB: fmt.Sprintf("db%04d", i), Rule: "r", Error: "gave up", At: time.Now()})
		require.NoError(t, err)
		f, err := e.JS.PublishAsync(subj.DeadLetter(g, fmt.Sprintf("db%04d", i)), data)
		require.NoError(t, err)
		futures = append(futures, f)
	}
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Fatal("no answer to a publish")
		}
	}
	list := func(args ...string) []admin.Record {
		t.Helper()
		var recs []admin.Record
		out := e.run(t, "deadletters", append([]string{"list", "--json"}, args...)...)
		require.NoError(t, json.Unmarshal([]byte(out), &recs), out)
		return recs
	}
	ids := func(recs []admin.Record) []uint64 {
		var out []uint64
		for _, r := range recs {
			out = append(out, r.ID)
		}
		return out
	}
	all := list("--limit", "0")
	require.Len(t, all, n)
	for i, r := range all {
		assert.Equal(t, uint64(n-i), r.ID, "newest first")
		assert.Equal(t, fmt.Sprintf("db%04d", n-i), r.DB)
	}
	assert.Equal(t, ids(all[:50]), ids(list()), "50 a page by default")
	page2 := list("--before", fmt.Sprint(all[1100].ID), "--limit", "1000")
	assert.Equal(t, ids(all[1101:2101]), ids(page2), "a page across spans")
	onchange := list("--group", "onchange", "--limit", "0")
	assert.Len(t, onchange, n/3)
	for _, r := range onchange {
		assert.Equal(t, events.GroupOnChange, r.Group)
	}
	assert.Equal(t, ids(all[5:7]), ids(list("--db", fmt.Sprintf("^db(%04d|%04d)$", n-5, n-6))))
	assert.Len(t, list("--since", "1h", "--limit", "0"), n)
	assert.Empty(t, list("--before", "1"))

	out := e.run(t, "deadletters", "list", "--limit", "3")
	assert.Contains(t, out, fmt.Sprintf("3 records (newest first); next page: --before %d, all: --limit 0", n-2))
	assert.Contains(t, out, fmt.Sprintf("db%04d", n))
	assert.NotContains(t, out, fmt.Sprintf("db%04d", n-3))
}
