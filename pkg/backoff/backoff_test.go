package backoff

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestDelayGrowsAndCaps(t *testing.T) {
	t.Parallel()
	p := Policy{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2}
	assert.Equal(t, 100*time.Millisecond, p.Delay(1))
	assert.Equal(t, 200*time.Millisecond, p.Delay(2))
	assert.Equal(t, 800*time.Millisecond, p.Delay(4))
	assert.Equal(t, time.Second, p.Delay(5))
	assert.Equal(t, time.Second, p.Delay(10000))
	assert.Equal(t, 100*time.Millisecond, p.Delay(0))
}

func TestJitterStaysInRange(t *testing.T) {
	t.Parallel()
	p := Policy{Initial: time.Second, Max: time.Second, Multiplier: 2, Jitter: 0.5}
	for range 1000 {
		d := p.Delay(3)
		assert.GreaterOrEqual(t, d, 500*time.Millisecond)
		assert.LessOrEqual(t, d, time.Second)
	}
}

func TestSleepEndsWithContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	assert.ErrorIs(t, Sleep(ctx, time.Hour), context.Canceled)
	assert.NoError(t, Sleep(t.Context(), time.Millisecond))
}

// A streak's wait follows how long the failures have lasted: a burst of failures at one moment
// waits Initial each (not Initial doubled per failure), later failures wait the streak's age up
// to Max, and a success starts over.
func TestStreakGrowsWithTimeNotCount(t *testing.T) {
	t.Parallel()
	p := Policy{Initial: 500 * time.Millisecond, Max: 30 * time.Second}
	var s Streak
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for range 20 {
		assert.Equal(t, 500*time.Millisecond, s.Failed(p, t0), "a burst escalated")
	}
	assert.Equal(t, 500*time.Millisecond, s.Failed(p, t0.Add(300*time.Millisecond)))
	assert.Equal(t, 4*time.Second, s.Failed(p, t0.Add(4*time.Second)))
	assert.Equal(t, 30*time.Second, s.Failed(p, t0.Add(10*time.Minute)))
	s.Succeeded()
	assert.Equal(t, 500*time.Millisecond, s.Failed(p, t0.Add(11*time.Minute)))

	p.Jitter = 0.2
	d := s.Failed(p, t0.Add(21*time.Minute))
	assert.True(t, d > 24*time.Second && d <= 30*time.Second, "jittered wait %s", d)
}
