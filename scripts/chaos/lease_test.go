package chaos

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestLeaseVerdict: a call by an onchange instance frozen off NATS counts as a violation only
// after AckWait + margin from the freeze and while it lasts; calls of other processes, calls
// before the limit and calls after the partition ended do not; a call without a known instance
// is counted as unidentified; a successor's first call for a db the frozen one served is timed.
func TestLeaseVerdict(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(d time.Duration) time.Time { return start.Add(d) }
	s := time.Second
	records := []faultRecord{
		{Fault: Fault{Kind: FaultPartitionNATS, Target: 4}, Began: 10 * s, Ended: 20 * s},            // onchange-1 frozen
		{Fault: Fault{Kind: FaultPartitionNATS, Target: 0, Cut: true}, Began: 10 * s, Ended: 20 * s}, // a producer: not checked
		{Fault: Fault{Kind: FaultPartitionCouch, Target: 5}, Began: 30 * s, Ended: 40 * s},           // CouchDB: not checked
	}
	pids := map[string][]int{"onchange-1": {100, 101}, "onchange-2": {200}, "producer-1": {300}}
	calls := []sinkCall{
		{At: at(9 * s), Instance: "h/100", DB: "a"},                              // before: makes db a recent
		{At: at(12 * s), Instance: "h/100", DB: "a"},                             // within the lease
		{At: at(10*s + 5*s + 900*time.Millisecond), Instance: "h/100"},           // within AckWait + margin (4s + 2s)
		{At: at(16500 * time.Millisecond), Instance: "h/100", DB: "a", ID: "d1"}, // violation
		{At: at(15 * s), Instance: "h/200", DB: "a"},                             // successor, 5s after the freeze
		{At: at(21 * s), Instance: "h/101", DB: "a"},                             // after the partition
		{At: at(35 * s), Instance: "h/200", DB: "b"},                             // during a CouchDB partition
		{At: at(36 * s), Instance: ""},                                           // unidentified
	}
	l := leaseVerdict(records, calls, pids, start, 4*s, 2*s)
	assert.Equal(t, 1, l.Partitions)
	assert.Equal(t, 1, l.Freezes)
	assert.Equal(t, 3, l.Calls)
	assert.Equal(t, 6500*time.Millisecond, l.Latest)
	assert.Equal(t, []time.Duration{5 * s}, l.Successor)
	assert.Equal(t, 1, l.Unidentified)
	if assert.Len(t, l.Violations, 1) {
		assert.Contains(t, l.Violations[0], "onchange-1 (h/100) called the webhook for a d1")
	}
	assert.Contains(t, l.String(), "1 violations")
}
