package main

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRefusedAddressDeadLettered: with no allow-list a rule whose URL leads to a loopback
// address (here through the name localhost) never reaches it; each change gets one dead letter
// naming the rule, the host and the reason, after one attempt whatever the retry policy says,
// and the rule's checkpoint moves on, so the refusal never loops.
func TestRefusedAddressDeadLettered(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	e.cfg.AllowedHosts = nil // closed by default
	s := newSink(t, nil)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	port := s.URL[strings.LastIndex(s.URL, ":")+1:]
	e.ruleIn(t, app, "internal", db, map[string]any{"url": "http://localhost:" + port + "/x", "method": "POST",
		"params": map[string]any{"id": "$change.id"}, "retry": map[string]any{"delay_ms": 5, "limit": 5}})
	e.Couch.Put(t, db, "d1", map[string]any{})
	e.Couch.Put(t, db, "d2", map[string]any{})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return len(e.deadLettersOf(t, db)) == 2 }, 20*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return e.caughtUp(t, "internal", db) }, 10*time.Second, 20*time.Millisecond)
	for _, d := range e.deadLettersOf(t, db) {
		assert.Equal(t, "internal", d.Rule)
		assert.Equal(t, 1, d.Attempts, "a refused address is not retried")
		assert.Zero(t, d.Status)
		assert.Contains(t, d.Error, `host "localhost" refused: the address dialled is a loopback address`)
		assert.Contains(t, d.Error, "SPIEGEL_WEBHOOK_ALLOWED_HOSTS")
	}
	assert.Empty(t, s.all(), "nothing reached the loopback receiver")
}

// TestSubjectRuleOutsideAllowedSpaceRejected: a subject rule aimed at the work queue or at
// JetStream's API is refused when the rule is loaded, with an error naming the rule and field;
// it never runs.
func TestSubjectRuleOutsideAllowedSpaceRejected(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	e.putRule(t, "into_work", map[string]any{"subject": "spiegel.work.onchange.${db_name}"})
	e.putRule(t, "into_api", map[string]any{"subject": "$JS.API.STREAM.DELETE.SPIEGEL_WORK"})
	require.Eventually(t, func() bool { return app.Rules.Stats().Rejected == 2 }, 10*time.Second, 20*time.Millisecond)
	st := app.Rules.Stats()
	assert.Contains(t, st.RejectedIDs["into_work"], `rule "into_work": field "subject"`)
	assert.Contains(t, st.RejectedIDs["into_work"], "service's own subjects")
	assert.Contains(t, st.RejectedIDs["into_api"], "NATS system subject")
	_, ok := app.Rules.Rule("into_work")
	assert.False(t, ok)
}

// TestAllowedSubjects: SPIEGEL_PUBLISH_ALLOWED_SUBJECTS narrows what subject rules may name.
func TestAllowedSubjects(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	e.cfg.AllowedSubjects = []string{"spiegel.changes.>"}
	app := e.start(t)
	waitRule(t, "inside", e.putRule(t, "inside", map[string]any{"subject": "spiegel.changes.${db_name}"}), app)
	e.putRule(t, "outside", map[string]any{"subject": "orders.${db_name}"})
	require.Eventually(t, func() bool { return app.Rules.Stats().Rejected == 1 }, 10*time.Second, 20*time.Millisecond)
	assert.Contains(t, app.Rules.Stats().RejectedIDs["outside"], "SPIEGEL_PUBLISH_ALLOWED_SUBJECTS")
}
