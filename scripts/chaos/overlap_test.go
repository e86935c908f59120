package chaos

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestOverlapVerdict: two instances' calls for one db in progress at once fail the run, whatever
// their rules, listed with both calls; calls back to back (within the tolerance), calls of one
// instance, calls for other dbs and the lingering call of a SIGSTOPped instance do not; a call
// without an instance is counted as unidentified.
func TestOverlapVerdict(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ms := time.Millisecond
	call := func(inst, rule, db, id string, from, to time.Duration) sinkCall {
		return sinkCall{At: start.Add(from), End: start.Add(to), Instance: inst, Rule: rule, DB: db, ID: id, Rev: "1-a", Delivery: "d-" + id}
	}
	pids := map[string][]int{"onchange-1": {100, 101}, "onchange-2": {200}}
	records := []faultRecord{{Fault: Fault{Kind: FaultStopProc, Target: 5}, Began: 20000 * ms, Ended: 26000 * ms}} // onchange-2 stopped

	tests := []struct {
		name       string
		calls      []sinkCall
		violations int
		excused    int
		contains   []string
	}{
		{"back to back", []sinkCall{
			call("h/100", slowPath, "a", "x", 1000*ms, 1800*ms),
			call("h/200", slowPath, "a", "y", 1800*ms, 2600*ms),
			call("h/100", slowPath, "a", "z", 2597*ms, 3000*ms), // 3ms: within the tolerance
		}, 0, 0, nil},
		{"same instance", []sinkCall{
			call("h/100", slowPath, "a", "x", 1000*ms, 1800*ms),
			call("h/100", hookPath, "a", "y", 1200*ms, 1300*ms),
		}, 0, 0, nil},
		{"other dbs", []sinkCall{
			call("h/100", slowPath, "a", "x", 1000*ms, 1800*ms),
			call("h/200", slowPath, "b", "y", 1200*ms, 1300*ms),
		}, 0, 0, nil},
		{"overlap", []sinkCall{
			call("h/100", slowPath, "a", "x", 1000*ms, 1800*ms),
			call("h/200", slowPath, "a", "y", 1700*ms, 2500*ms),
		}, 1, 0, []string{"a: onchange-1 (h/100) slow x 1-a delivery d-x +1s–+1.8s and onchange-2 (h/200) slow y 1-a delivery d-y +1.7s–+2.5s", "for 100ms"}},
		{"overlap across rules and incarnations", []sinkCall{
			call("h/100", hookPath, "a", "x", 1000*ms, 3000*ms),
			call("h/101", slowPath, "a", "y", 2000*ms, 2100*ms),
		}, 1, 0, []string{"onchange-1 (h/100) hook x", "onchange-1 (h/101) slow y"}},
		{"inside a longer call", []sinkCall{
			call("h/100", slowPath, "a", "x", 1000*ms, 5000*ms),
			call("h/100", slowPath, "a", "w", 1100*ms, 1200*ms),
			call("h/200", slowPath, "a", "y", 4000*ms, 4100*ms),
		}, 1, 0, []string{"onchange-1 (h/100) slow x"}},
		{"stopped instance's call lingers", []sinkCall{
			call("h/200", hookPath, "a", "x", 19900*ms, 22900*ms), // sent before the SIGSTOP, answered during it
			call("h/100", hookPath, "a", "y", 22500*ms, 22600*ms),
		}, 0, 1, nil},
		{"stopped later than the overlap began", []sinkCall{
			call("h/200", hookPath, "a", "x", 19000*ms, 22000*ms),
			call("h/100", hookPath, "a", "y", 19500*ms, 19600*ms),
		}, 1, 0, nil},
		{"unknown process", []sinkCall{
			call("h/999", hookPath, "a", "x", 1000*ms, 2000*ms),
			call("h/100", hookPath, "a", "y", 1500*ms, 1600*ms),
		}, 1, 0, []string{"unknown process (h/999)"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			o := overlapVerdict(tt.calls, pids, records, start, start.Add(time.Minute), 4*time.Second)
			assert.Len(t, o.Violations, tt.violations, "%v", o.Violations)
			assert.Len(t, o.Excused, tt.excused, "%v", o.Excused)
			assert.Equal(t, len(tt.calls), o.Calls)
			for _, s := range tt.contains {
				require.NotEmpty(t, o.Violations)
				assert.Contains(t, o.Violations[0], s)
			}
			res := &Result{Overlap: &o, Verdict: &verdict{}}
			assert.Equal(t, tt.violations > 0, len(res.overlapFailures()) > 0)
			assert.Equal(t, tt.violations == 0, res.Pass(), "a violation fails the run")
		})
	}
}

// A call still in progress ends at now; a call without X-Spiegel-Instance is not checked but
// fails the run (the verdict could not check it).
func TestOverlapVerdictOpenAndUnidentified(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s := time.Second
	calls := []sinkCall{
		{At: start.Add(1 * s), Instance: "h/100", DB: "a"}, // no answer yet
		{At: start.Add(8 * s), End: start.Add(9 * s), Instance: "h/200", DB: "a"},
		{At: start.Add(8 * s), End: start.Add(9 * s), DB: "a"},
	}
	o := overlapVerdict(calls, map[string][]int{"onchange-1": {100}}, nil, start, start.Add(10*s), 4*s)
	assert.Len(t, o.Violations, 1)
	assert.Equal(t, 1, o.Unidentified)
	assert.Equal(t, 2, o.Calls)
	res := &Result{Overlap: &o}
	assert.Len(t, res.overlapFailures(), 2)
}

// The block rule's stretches: one instance's calls for one db, each starting less than AckWait
// after the previous ended; the onchange consumer's leader changes that began during one of at
// least AckWait are counted.
func TestOverlapSlowStretches(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s := time.Second
	var calls []sinkCall
	for i := range 15 { // h/100: 0s–14.8s, one call a second
		at := time.Duration(i) * s
		calls = append(calls, sinkCall{At: start.Add(at), End: start.Add(at + 800*time.Millisecond), Instance: "h/100", Rule: slowPath, DB: "a"})
	}
	calls = append(calls,
		sinkCall{At: start.Add(30 * s), End: start.Add(31 * s), Instance: "h/200", Rule: slowPath, DB: "a"}, // another stretch, short
		sinkCall{At: start.Add(2 * s), End: start.Add(40 * s), Instance: "h/200", Rule: hookPath, DB: "b"},  // not the block rule
	)
	records := []faultRecord{
		{Fault: Fault{Kind: FaultStepdownConsumer, Target: 0}, Began: 5 * s},
		{Fault: Fault{Kind: FaultNATSConsumerLdr, Target: 0}, Began: 20 * s},
		{Fault: Fault{Kind: FaultStepdownConsumer, Target: 1}, Began: 6 * s},                     // the replicator's
		{Fault: Fault{Kind: FaultStepdownConsumer, Target: 0}, Began: 7 * s, Skipped: "skipped"}, // did not run
	}
	o := overlapVerdict(calls, map[string][]int{"onchange-1": {100}, "onchange-2": {200}}, records, start, start.Add(time.Minute), 4*s)
	assert.Empty(t, o.Violations)
	assert.Equal(t, 14800*time.Millisecond, o.Longest)
	assert.Equal(t, "a", o.LongestDB)
	assert.Equal(t, 1, o.LongStretches)
	assert.Equal(t, 2, o.LeaderChanges)
	assert.Equal(t, 1, o.InLongJobs)
	assert.Contains(t, o.String(), "1 of 2 onchange consumer leader changes during one")
}

// The aimed leader changes: one that began inside a block job of at least AckWait of the db and
// instance it aimed at, while its call was open, landed; one that struck without a job, one
// whose job turned out shorter than AckWait and one left out did not, each with its reason. A
// run whose aimed faults all missed fails saying why; one with a landing, or with every aimed
// fault left out, does not.
func TestOverlapAimedFaults(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s, ms := time.Second, time.Millisecond
	var calls []sinkCall
	for i := range 12 { // h/100 on db a: 10s–21.5s, a call every second, each answered after 500ms
		at := 10*s + time.Duration(i)*s
		calls = append(calls, sinkCall{At: start.Add(at), End: start.Add(at + 500*ms), Instance: "h/100", Rule: slowPath, DB: "a", ID: fmt.Sprintf("d%d", i)})
	}
	calls = append(calls, sinkCall{At: start.Add(30 * s), End: start.Add(32 * s), Instance: "h/200", Rule: slowPath, DB: "b", ID: "e"}) // 2s: short
	pids := map[string][]int{"onchange-1": {100}, "onchange-2": {200}}
	jobA := blockJob{DB: "a", Instance: "h/100", Start: 10 * s, Open: &timedCall{sinkCall: sinkCall{Instance: "h/100", ID: "d5"}, start: 15 * s}}
	jobB := blockJob{DB: "b", Instance: "h/200", Start: 30 * s}
	landed := faultRecord{Fault: Fault{Kind: FaultStepdownConsumer, At: 9 * s, InBlockJob: true}, Started: 9 * s, Began: 15200 * ms,
		Aim: &aimRecord{Job: jobA, Age: 5200 * ms, Before: "n1", After: "n2"}}
	missed := faultRecord{Fault: Fault{Kind: FaultNATSConsumerLdr, At: 3 * s, InBlockJob: true}, Started: 3 * s, Began: 33 * s,
		Aim: &aimRecord{Missed: "no block job of at least AckWait (4s) was in progress within 30s", Before: "n2", After: "n3"}}
	short := faultRecord{Fault: Fault{Kind: FaultNATSConsumerLdr, At: 25 * s, InBlockJob: true}, Started: 25 * s, Began: 31 * s,
		Aim: &aimRecord{Job: jobB, Age: s, Before: "n3", After: "n1"}}
	skipped := faultRecord{Fault: Fault{Kind: FaultStepdownConsumer, At: 5 * s, InBlockJob: true}, Started: 5 * s, Skipped: "CHAOS_SKIP_FAULTS"}
	unaimed := faultRecord{Fault: Fault{Kind: FaultStepdownConsumer, At: 12 * s}, Started: 12 * s, Began: 12 * s} // a drawn one: counted, not aimed

	check := func(records ...faultRecord) overlapResult {
		return overlapVerdict(calls, pids, records, start, start.Add(time.Minute), 4*s)
	}

	o := check(landed, missed, short, skipped, unaimed)
	assert.Equal(t, 4, o.Aimed)
	assert.Equal(t, 1, o.AimSkipped)
	assert.Equal(t, 1, o.AimedLanded)
	assert.Equal(t, 4, o.LeaderChanges)
	assert.Equal(t, 2, o.InLongJobs, "the landed one and the drawn one fell in db a's job")
	require.Len(t, o.AimLines, 4)
	assert.Equal(t, "stepdown-work-consumer onchange planned at +9s (plan +9s): struck at +15.2s (waited 6.2s) inside the block job of a by onchange-1 (h/100), "+
		"running 5.2s of its 11.5s; call d5 open then, answered 300ms later; leader nats-n1 → nats-n2", o.AimLines[0])
	require.Len(t, o.AimMisses, 3)
	assert.Contains(t, o.AimMisses[0], "kill-nats-consumer-leader onchange planned at +3s (plan +3s): struck at +33s: struck without a block job: no block job of at least AckWait (4s)")
	assert.Contains(t, o.AimMisses[2], "stepdown-work-consumer onchange planned at +5s (plan +5s): not run (CHAOS_SKIP_FAULTS)")
	assert.Contains(t, o.AimMisses[1], "planned at +25s (plan +25s): struck at +31s (waited 6s) inside the block job of b by h/200, running 1s; leader nats-n3 → nats-n1, but the sink's calls show no job of at least AckWait there")
	assert.Contains(t, o.String(), "1 of 4 aimed leader changes landed inside a block job of at least AckWait")
	assert.Empty(t, o.aimFailures())
	res := &Result{Overlap: &o, Verdict: &verdict{}}
	assert.True(t, res.Pass())

	o = check(missed, short, skipped)
	require.Len(t, o.aimFailures(), 1)
	assert.Contains(t, o.aimFailures()[0], "no onchange consumer leader change landed inside a block job of at least AckWait (3 aimed): kill-nats-consumer-leader onchange planned at +3s (plan +3s)")
	res = &Result{Overlap: &o, Verdict: &verdict{}}
	assert.False(t, res.Pass(), "no aimed fault landed: the overlap verdict was not exercised")
	assert.Contains(t, res.overlapFailures(), o.aimFailures()[0])

	o = check(skipped)
	assert.Empty(t, o.aimFailures(), "every aimed fault left out: nothing to require")
	o = check(unaimed)
	assert.Equal(t, 0, o.Aimed)
	assert.Empty(t, o.aimFailures(), "a plan without aimed faults requires none")
}
