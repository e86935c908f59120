package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestSubjectFilter: a rule's subject template becomes the filter of all its subjects, or none
// when ${db_name} is only part of a token.
func TestSubjectFilter(t *testing.T) {
	t.Parallel()
	for tmpl, want := range map[string]string{
		"spiegel.changes.${db_name}":     "spiegel.changes.*",
		"a.${db_name}.b":                 "a.*.b",
		"fixed.subject":                  "fixed.subject",
		"a.db-${db_name}":                "",
		"spiegel.changes.${db_name}.doc": "spiegel.changes.*.doc",
	} {
		assert.Equal(t, want, subjectFilter(tmpl), tmpl)
	}
}

// TestReplayIDs: a new replay id is a valid one, and different every time; ids that could break
// a message id or the checkpoint's replay mark are refused.
func TestReplayIDs(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 25, 17, 5, 12, 0, time.UTC)
	a, b := newReplayID(now), newReplayID(now)
	assert.Regexp(t, `^20261125T170512Z-[0-9a-f]{8}$`, a)
	assert.NotEqual(t, a, b)
	assert.True(t, replayIDPattern.MatchString(a))
	for _, bad := range []string{"", "a b", "a/b", "a.b", "ä", string(make([]byte, 65))} {
		assert.False(t, replayIDPattern.MatchString(bad), "%q", bad)
	}
}
