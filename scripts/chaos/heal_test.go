package chaos

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A class's time to heal is its slowest probe's, and the verdict says which destination that
// probe reached last and when each got it after the fault ended; a probe missing somewhere is
// named as not healed.
func TestHealSummarySplitsTheSlowestProbe(t *testing.T) {
	t.Parallel()
	s := func(n int) time.Duration { return time.Duration(n) * time.Second }
	p := &prober{probes: []*probe{
		{Kind: FaultKillProc, DB: "a", ID: "p1", Rev: "1-a", Ended: s(10), Target: s(12), Hook: s(11), Stream: s(13)},
		{Kind: FaultKillProc, DB: "a", ID: "p2", Rev: "1-b", Ended: s(20), Target: s(25), Hook: s(61), Stream: s(30)},
		{Kind: FaultSink500, DB: "b", ID: "p3", Rev: "1-c", Ended: s(20), Target: s(21), Hook: 0, Stream: s(22)},
	}}
	sum := p.summary()
	require.Len(t, sum, 2)
	kill := sum[0]
	assert.Equal(t, s(41), kill.Max)
	assert.Equal(t, "webhook", kill.Slowest)
	assert.Equal(t, []time.Duration{s(5), s(41), s(10)}, []time.Duration{kill.Target, kill.Hook, kill.Stream})
	assert.Contains(t, kill.String(), "[max: webhook last; target 5s, webhook 41s, stream 10s]")
	assert.Equal(t, []string{"b/p3 (not in webhook)"}, sum[1].Unhealed)
}
