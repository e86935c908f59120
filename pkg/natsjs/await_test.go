package natsjs

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	logtest "github.com/sirupsen/logrus/hooks/test"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestAwaitInstalledRetriesWhatIsNotAMissingInstallation: a daemon started while the JetStream
// cluster elects a leader gets "look up stream SPIEGEL_WAKEUPS: context deadline exceeded" from
// its installation check (found by the chaos suite: the process exited). It waits instead, as
// it does for NATS itself, and gives up only on a missing installation or its context.
func TestAwaitInstalledRetriesWhatIsNotAMissingInstallation(t *testing.T) {
	timeout := fmt.Errorf("look up stream SPIEGEL_WAKEUPS: %w", context.DeadlineExceeded)

	t.Run("transient errors are retried until the check passes", func(t *testing.T) {
		log, hook := logtest.NewNullLogger()
		calls := 0
		err := AwaitInstalled(t.Context(), log, func(context.Context) error {
			if calls++; calls < 3 {
				return timeout
			}
			return nil
		})
		require.NoError(t, err)
		assert.Equal(t, 3, calls)
		require.Len(t, hook.AllEntries(), 2)
		assert.Contains(t, hook.AllEntries()[0].Data["error"], "context deadline exceeded")
	})

	t.Run("a missing installation is returned at once", func(t *testing.T) {
		log, _ := logtest.NewNullLogger()
		calls := 0
		err := AwaitInstalled(t.Context(), log, func(context.Context) error {
			calls++
			return fmt.Errorf("stream SPIEGEL_WORK is missing: %w", ErrNotInstalled)
		})
		require.ErrorIs(t, err, ErrNotInstalled)
		assert.Equal(t, 1, calls)
	})

	t.Run("the end of the context ends the wait with the last error", func(t *testing.T) {
		log, _ := logtest.NewNullLogger()
		ctx, cancel := context.WithTimeout(t.Context(), 600*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := AwaitInstalled(ctx, log, func(context.Context) error { return timeout })
		require.True(t, errors.Is(err, context.DeadlineExceeded))
		assert.Contains(t, err.Error(), "SPIEGEL_WAKEUPS")
		assert.Less(t, time.Since(start), 5*time.Second)
	})
}
