package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/status"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// statusJSON runs `producer status --json args...` and decodes it.
func (e *env) statusJSON(t *testing.T, args ...string) admin.StatusReport {
	t.Helper()
	out := e.run(t, "status", append([]string{"--json"}, args...)...)
	var rep admin.StatusReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	return rep
}

func ruleByID(t *testing.T, rep admin.StatusReport, id string) admin.RuleStatus {
	t.Helper()
	for _, r := range rep.PerRule {
		if r.ID == id {
			return r
		}
	}
	t.Fatalf("rule %s not in the status: %+v", id, rep.PerRule)
	return admin.RuleStatus{}
}

// `producer status` reports every rule from a known state: dbs matched, on_change dbs behind
// their checkpoints (with and without a pending job) and the oldest one's age, dead letters
// per rule, and what the running consumers of its own subject prefix say — never another
// installation's, never a password.
func TestStatusPerRule(t *testing.T) {
	e := newEnv(t)
	for _, n := range []string{"u1", "u2", "u3", "x1"} {
		e.Couch.CreateDB(t, e.Prefix+n)
		e.Couch.Put(t, e.Prefix+n, "doc", map[string]any{"n": n})
	}
	users := "^" + e.Prefix + "u"
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": users, "url": "http://hooks@127.0.0.1:1/"})
	e.putRule(t, "late", map[string]any{"type": "on_change", "db_name": users, "url": "http://127.0.0.1:1/", "since": "now"})
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": users, "source": "$db_name", "target": e.Prefix + "all"})
	e.putRule(t, "off", map[string]any{"type": "replicator", "source": e.Prefix + "u1", "target": e.Prefix + "all", "disabled": true})

	// hook is up to date in u1, has never run in u2 (whose job is pending) nor in u3 (no job).
	cc, err := couch.New(couch.Config{URL: e.direct.URL}, nil)
	require.NoError(t, err)
	kv, err := natsjs.OnChangeBucket(t.Context(), e.JS, natsjs.DefaultTopology(""))
	require.NoError(t, err)
	store := checkpoint.NewOnChangeStore(cc, kv)
	page, err := cc.Changes(t.Context(), e.Prefix+"u1", couch.ChangesOptions{})
	require.NoError(t, err)
	cp, err := store.Load(t.Context(), "hook", e.Prefix+"u1")
	require.NoError(t, err)
	require.NoError(t, store.Save(t.Context(), &cp, page.LastSeq))
	e.Enqueue(t, events.GroupOnChange, e.Prefix+"u2")

	dl := worker.NewDeadLetters(e.JS, events.NewSubjects(""))
	for i, rule := range []string{"hook", "hook", "rep", ""} {
		require.NoError(t, dl.Publish(t.Context(), worker.DeadLetter{Group: events.GroupOnChange, DB: e.Prefix + "u1", Rule: rule,
			Error: fmt.Sprintf("request %d to http://hooks:SECRETPW@hook.example/ failed", i)}))
	}

	// A replicator of this installation, and one of another on the same NATS.
	nc, _ := e.NATS.Connect(t)
	rec := status.NewRecorder()
	rec.RuleRun("rep", status.ResultError, errors.New("replicate to http://repl:SECRETPW@target.example/: 503"))
	rec.RuleRun("rep", status.ResultOK, nil)
	svc, err := status.Register(nc, status.Config{Prefix: "spiegel", Component: status.ComponentReplicator, Version: "1.2.3",
		Report: func(rep *status.Report) { rep.DefaultEngine = "native"; rec.Fill(rep) }})
	require.NoError(t, err)
	defer func() { _ = svc.Stop() }()
	other := status.NewRecorder()
	for range 100 {
		other.RuleRun("rep", status.ResultFailed, errors.New("other installation"))
	}
	osvc, err := status.Register(nc, status.Config{Prefix: "staging", Component: status.ComponentReplicator, Version: "1.2.3",
		Report: func(rep *status.Report) { rep.DefaultEngine = "couchdb"; other.Fill(rep) }})
	require.NoError(t, err)
	defer func() { _ = osvc.Stop() }()
	require.NoError(t, nc.Flush())

	rep := e.statusJSON(t)
	assert.Equal(t, 3, rep.Rules.Replicators+rep.Rules.OnChanges)
	require.Len(t, rep.Processes, 1, "only this installation's processes")
	assert.Equal(t, svc.ID(), rep.Processes[0].ID)
	assert.Equal(t, "spiegel-replicator", rep.Processes[0].Service)
	require.Len(t, rep.PerRule, 4)
	assert.Empty(t, rep.Incomplete)

	hook := ruleByID(t, rep, "hook")
	assert.Equal(t, "on_change", hook.Kind)
	assert.Equal(t, users, hook.Pattern)
	assert.True(t, hook.Enabled)
	assert.Equal(t, 3, hook.DBsMatched)
	require.NotNil(t, hook.DBsBehind)
	assert.Equal(t, 2, *hook.DBsBehind, "u2 and u3 have changes after the checkpoint")
	assert.Equal(t, 1, hook.DBsBehindNoJob, "u3 has no pending job")
	assert.Equal(t, e.Prefix+"u2", hook.OldestDB)
	require.NotNil(t, hook.OldestAgeSeconds)
	assert.GreaterOrEqual(t, *hook.OldestAgeSeconds, 0.0)
	assert.Less(t, *hook.OldestAgeSeconds, 120.0)
	assert.Equal(t, 2, hook.DeadLetters)
	assert.Nil(t, hook.LastRun, "no onchange consumer answered")

	late := ruleByID(t, rep, "late")
	require.NotNil(t, late.DBsBehind)
	assert.Zero(t, *late.DBsBehind, "a since:now rule starts at the end of each db")

	r := ruleByID(t, rep, "rep")
	assert.Equal(t, "replicator", r.Kind)
	assert.Equal(t, "native (default)", r.Engine)
	assert.Equal(t, 3, r.DBsMatched)
	assert.Nil(t, r.DBsBehind)
	require.NotNil(t, r.LastRun)
	assert.Equal(t, status.ResultOK, r.LastResult)
	assert.Equal(t, uint64(2), r.Runs)
	assert.Equal(t, 1, r.FailuresLastHour)
	assert.Equal(t, 1, r.DeadLetters)

	off := ruleByID(t, rep, "off")
	assert.False(t, off.Enabled)
	assert.Equal(t, e.Prefix+"u1", off.Pattern)
	assert.Equal(t, 1, off.DBsMatched)

	// --rule restricts the per-rule part; the text form has the same figures.
	rep = e.statusJSON(t, "--rule", "hook")
	require.Len(t, rep.PerRule, 1)
	assert.Equal(t, "hook", rep.PerRule[0].ID)
	text := e.run(t, "status", "--rule", "hook")
	assert.Regexp(t, `jobs onchange\s+pending 1,`, text, "the summary stays on top")
	assert.Regexp(t, `hook\s+on_change\s+\S+\s+-\s+yes\s+3\s+2 \(1 without job\)\s+\d+s \(`+regexp.QuoteMeta(e.Prefix)+`u2\)\s+-\s+-\s+0\s+2`, text)
	assert.Contains(t, text, "spiegel-replicator")

	text = e.run(t, "status")
	assert.Regexp(t, `rep\s+replicator\s+\S+\s+native \(default\)\s+yes\s+3\s+-\s+-\s+\d+s ago\s+ok\s+1\s+1`, text)
	for _, out := range []string{text, e.run(t, "status", "--json")} {
		assert.NotContains(t, out, "SECRETPW")
		assert.NotContains(t, out, "other installation")
	}

	cfg := e.cfg
	err = runStatus(t.Context(), &cfg, discardLogger(), cmdIO{args: []string{"--rule", "nope"}, stdout: &bytes.Buffer{}, stderr: &bytes.Buffer{}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), `no rule "nope"`)
}
