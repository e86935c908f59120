package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

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
