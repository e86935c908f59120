// Package backoff computes capped, jittered retry delays and sleeps that end with their context.
package backoff

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"time"
)

// Policy is an exponential backoff: Initial × Multiplier^(attempt-1), capped at Max, with up to
// Jitter (a fraction, 0–1) of the delay taken off at random so that many clients retrying the
// same server spread out.
type Policy struct {
	Initial    time.Duration
	Max        time.Duration
	Multiplier float64
	Jitter     float64
}

// Default is the policy for reconnecting to CouchDB and NATS: 250ms doubling to 30s, 20% jitter.
var Default = Policy{Initial: 250 * time.Millisecond, Max: 30 * time.Second, Multiplier: 2, Jitter: 0.2}

// Delay returns the wait before retry number attempt (1 for the first retry). It never exceeds
// Max and never returns less than zero.
func (p Policy) Delay(attempt int) time.Duration {
	if attempt < 1 {
		attempt = 1
	}
	mult := p.Multiplier
	if mult < 1 {
		mult = 1
	}
	d := float64(p.Initial) * math.Pow(mult, float64(attempt-1))
	if p.Max > 0 && (d > float64(p.Max) || math.IsInf(d, 0) || math.IsNaN(d)) {
		d = float64(p.Max)
	}
	if p.Jitter > 0 {
		d -= d * p.Jitter * rand.Float64()
	}
	if d < 0 {
		return 0
	}
	return time.Duration(d)
}

// Sleep waits for d or until ctx ends, whichever comes first, and returns ctx.Err() in the latter
// case.
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Streak paces retries by how long a run of failures has lasted, not by how many failures it
// counted: many callers failing at the same moment (one outage seen by every job in flight) wait
// as long as one caller would, and the wait grows only while the failures go on. For one
// caller retrying alone it doubles like Policy.Delay. The zero value is ready; it is safe for
// concurrent use.
type Streak struct {
	mu    sync.Mutex
	since time.Time // when the current run of failures began; zero: none
}

// Failed records a failure at now and returns the wait before its retry: how long the failures
// have lasted, at least p.Initial and at most p.Max, less up to p.Jitter of it.
func (s *Streak) Failed(p Policy, now time.Time) time.Duration {
	s.mu.Lock()
	if s.since.IsZero() {
		s.since = now
	}
	d := now.Sub(s.since)
	s.mu.Unlock()
	d = max(d, p.Initial)
	if p.Max > 0 {
		d = min(d, p.Max)
	}
	if p.Jitter > 0 {
		d -= time.Duration(float64(d) * p.Jitter * rand.Float64())
	}
	return max(d, 0)
}

// Succeeded ends the run of failures.
func (s *Streak) Succeeded() {
	s.mu.Lock()
	s.since = time.Time{}
	s.mu.Unlock()
}
