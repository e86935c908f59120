package worker

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// fakeWake answers ChangedSince from a script per db and records the calls.
type fakeWake struct {
	mu      sync.Mutex
	answers map[string][]error // nil error → changed; errNoChange → not changed; other → error
	calls   []string
}

var errNoChange = errors.New("no change")

func (f *fakeWake) ChangedSince(_ context.Context, db, seq string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, db+"@"+seq)
	script := f.answers[db]
	if len(script) == 0 {
		return false, nil
	}
	answer := script[0]
	f.answers[db] = script[1:]
	switch {
	case answer == nil:
		return true, nil
	case errors.Is(answer, errNoChange):
		return false, nil
	default:
		return false, answer
	}
}

func (f *fakeWake) callList() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func TestLostWakeupRunsTheJobAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	wake := &fakeWake{answers: map[string][]error{
		"changed":      {nil},                           // changed once after the first run
		"check-fails":  {errors.New("couchdb is down")}, // unknown: republish to be safe
		"unchanged":    {errNoChange},
		"not-reported": {nil}, // never asked: its handler does not call Reached
		"empty":        {nil}, // reached "" (found empty): a write during the job still wakes it
	}}
	var rec recorder
	r := e.newRunner(t, nil, testConfig(), func(_ context.Context, job *Job) error {
		rec.add(job)
		switch job.DB {
		case "not-reported":
		case "empty":
			job.Reached("")
		default:
			job.Reached("4")
			job.Reached("5") // the last call wins
		}
		return nil
	}, wake)
	start(t, r)
	for _, db := range []string{"changed", "check-fails", "unchanged", "not-reported", "empty"} {
		e.publish(t, db, events.TypeUpdated)
	}

	require.Eventually(t, func() bool { return rec.count() >= 8 }, waitFor, tick)
	e.requireDrained(t)
	require.Eventually(t, func() bool { return len(wake.callList()) >= 7 }, waitFor, tick)

	reasons := map[string][]string{}
	for _, c := range rec.all() {
		reasons[c.DB] = append(reasons[c.DB], c.Reason)
	}
	assert.Equal(t, []string{events.TypeUpdated, events.ReasonWakeup}, reasons["changed"])
	assert.Equal(t, []string{events.TypeUpdated, events.ReasonWakeup}, reasons["check-fails"])
	assert.Equal(t, []string{events.TypeUpdated}, reasons["unchanged"])
	assert.Equal(t, []string{events.TypeUpdated}, reasons["not-reported"])
	assert.Equal(t, []string{events.TypeUpdated, events.ReasonWakeup}, reasons["empty"])
	assert.ElementsMatch(t, []string{"changed@5", "changed@5", "check-fails@5", "check-fails@5", "unchanged@5", "empty@", "empty@"}, wake.callList())
}
