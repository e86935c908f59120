package admin

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A cluster formed moments ago refuses to place streams for a while: install tries again
// within its wait, and gives up on anything else at once.
func TestEnsureTopologyWaitsForPlacement(t *testing.T) {
	t.Parallel()
	noPeers := &jetstream.APIError{Code: 400, ErrorCode: errCodeNoPeers, Description: "no suitable peers for placement, peer offline"}
	unavailable := &jetstream.APIError{Code: 503, ErrorCode: errCodeTemporarilyBlocked, Description: "JetStream system temporarily unavailable"}
	other := &jetstream.APIError{Code: 400, ErrorCode: 10058, Description: "stream name already in use"}
	for _, c := range []struct {
		name    string
		answers []error
		wait    time.Duration
		calls   int
		want    error
	}{
		{"placed at the third attempt", []error{noPeers, unavailable, nil}, time.Minute, 3, nil},
		{"another refusal is final", []error{other, nil}, time.Minute, 1, other},
		{"a plain error is final", []error{errors.New("nats: connection closed"), nil}, time.Minute, 1, nil},
		{"the wait runs out", []error{noPeers, noPeers, noPeers, noPeers}, 25 * time.Millisecond, -3, noPeers}, // -3: at most 3
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			calls := 0
			err := ensureTopology(t.Context(), func(context.Context) error {
				calls++
				return c.answers[min(calls, len(c.answers))-1]
			}, c.wait, 10*time.Millisecond)
			if c.calls < 0 {
				assert.LessOrEqual(t, calls, -c.calls, "no attempt after the wait")
			} else {
				assert.Equal(t, c.calls, calls)
			}
			switch {
			case c.name == "a plain error is final":
				require.ErrorContains(t, err, "connection closed")
			case c.want == nil:
				require.NoError(t, err)
			default:
				require.ErrorIs(t, err, c.want)
			}
		})
	}
}
