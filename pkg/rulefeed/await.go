package rulefeed

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ErrRulesBehind means the rule set has not applied the rule changes a job was published with
// (events.Job Rules) within the wait: the job is retried later, never run with older rules.
var ErrRulesBehind = errors.New("the rule feed has not yet applied the rules this job was published with")

// maxCovered bounds the rule-set seqs Await remembers as covered.
const maxCovered = 1024

// AppliedSeq returns the spiegel db seq up to which the rule set has applied every change (rule
// docs and the service's own docs alike): what a producer stamps on the jobs it publishes
// (events.Job Rules). "" until the rules are loaded.
func (f *Follower) AppliedSeq() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.applied
}

// setApplied records that the rule set has applied every change up to seq, and wakes Await.
func (f *Follower) setApplied(seq string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if seq == "" || seq == f.applied {
		return
	}
	f.applied = seq
	if f.moved != nil {
		close(f.moved)
	}
	f.moved = make(chan struct{})
}

// appliedState returns the applied seq and a channel closed when it moves next.
func (f *Follower) appliedState() (string, <-chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.moved == nil {
		f.moved = make(chan struct{})
	}
	return f.applied, f.moved
}

// Await returns once the rule set has applied every rule change up to seq, a spiegel db seq
// that another process's follower had applied (events.Job Rules; "" returns at once), or
// ErrRulesBehind after wait. Seqs are opaque: the same string is the same state; otherwise
// CouchDB is asked whether the spiegel db changed after this follower's own seq (one _changes
// row) — no row means this rule set is current, so it covers seq too. A covered seq is
// remembered, so that jobs of one producer state cost one question per process, not one each;
// while this follower lags, Await waits for its feed to apply more and looks again.
func (f *Follower) Await(ctx context.Context, seq string, wait time.Duration) error {
	if seq == "" || f.isCovered(seq) {
		return nil
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		mine, moved := f.appliedState()
		if mine == seq {
			f.cover(seq)
			return nil
		}
		if mine != "" {
			behind, err := f.Couch.ChangedSince(ctx, f.DB, mine)
			if err == nil && !behind {
				f.cover(seq)
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-timer.C:
			return fmt.Errorf("%w (waited %s for seq %q, at %q)", ErrRulesBehind, wait, seq, mine)
		case <-moved:
		}
	}
}

func (f *Follower) isCovered(seq string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.covered[seq]
}

func (f *Follower) cover(seq string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.covered == nil || len(f.covered) >= maxCovered {
		f.covered = map[string]bool{}
	}
	f.covered[seq] = true
}
