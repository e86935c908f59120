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
