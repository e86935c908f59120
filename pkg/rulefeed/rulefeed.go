// Package rulefeed keeps a rules.Set in step with the spiegel db: a full load, then the db's
// continuous _changes feed, so that creating, editing and deleting a rule takes effect within
// seconds in every process.
package rulefeed

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// Metrics receives the follower's counts; nil records nothing.
type Metrics interface {
	FeedError()
	RuleStats(st rules.Stats)
}

// DefaultRetry is the backoff of a failed OnAdded or catch-up pass.
var DefaultRetry = backoff.Policy{Initial: 500 * time.Millisecond, Max: 30 * time.Second, Multiplier: 2, Jitter: 0.2}

// Follower follows the rule docs of one spiegel db into a rules.Set.
type Follower struct {
	Couch   *couch.Client
	DB      string
	Set     *rules.Set
	Log     logrus.FieldLogger
	Metrics Metrics
	// OnAdded is called, live, for every rule that is new or edited (may be nil); its error is
	// retried with capped backoff until it succeeds or ctx ends, and the rule is recorded as
	// enqueued (EnqueuedSeq) only then. It must return only once its work is durable.
	OnAdded func(ctx context.Context, r rules.Rule) error
	// OnRemoved is called, live, for every rule that a change replaced or removed (may be nil):
	// old is the rule as it was, now the rule that replaced it (nil: deleted, or invalid now).
	// It must not block: the rule feed waits for it.
	OnRemoved func(old, now rules.Rule)
	// Retry is the backoff of a failed OnAdded or catch-up pass; zero means DefaultRetry.
	Retry backoff.Policy

	mu sync.Mutex
	// enqueuedSeq is the spiegel db seq up to which onAdded has run for every rule change.
	enqueuedSeq string
	// applied is the spiegel db seq up to which Set reflects every change (AppliedSeq); moved
	// is closed when it moves; covered are seqs Await found covered.
	applied string
	moved   chan struct{}
	covered map[string]bool
}

// EnqueuedSeq returns the seq up to which new rules have had their dbs enqueued. The service's
// own docs in the spiegel db (rules.IsServiceDocID) never move it, so that saving it (with the
// producer's position, a doc of the spiegel db) is not a write caused by the previous save.
func (f *Follower) EnqueuedSeq() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.enqueuedSeq
}

func (f *Follower) setEnqueued(seq string) {
	f.mu.Lock()
	f.enqueuedSeq = seq
	f.mu.Unlock()
}

func (f *Follower) retry() backoff.Policy {
	if f.Retry == (backoff.Policy{}) {
		return DefaultRetry
	}
	return f.Retry
}

// added runs OnAdded for r until it succeeds; false when ctx ended first.
func (f *Follower) added(ctx context.Context, r rules.Rule) bool {
	if f.OnAdded == nil {
		return true
	}
	for attempt := 1; ; attempt++ {
		err := f.OnAdded(ctx, r)
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		delay := f.retry().Delay(attempt)
		f.Log.WithError(err).WithFields(logrus.Fields{"rule": r.ID(), "attempt": attempt, "delay": delay.String()}).
			Warn("enqueue the dbs of a new or edited rule failed: retrying")
		if backoff.Sleep(ctx, delay) != nil {
			return false
		}
	}
}

// CatchUp calls OnAdded for every enabled rule changed after since ("" = every rule): the rules
// added or edited while no producer was running. A pass that fails is retried with capped
// backoff until it succeeds or ctx ends; EnqueuedSeq becomes until only when it succeeded.
func (f *Follower) CatchUp(ctx context.Context, since, until string) {
	for attempt := 1; ; attempt++ {
		err := f.catchUp(ctx, since)
		if err == nil {
			if until != "" {
				f.setEnqueued(until)
			}
			return
		}
		if ctx.Err() != nil {
			return
		}
		delay := f.retry().Delay(attempt)
		f.Log.WithError(err).WithFields(logrus.Fields{"attempt": attempt, "delay": delay.String()}).
			Warn("enqueue the dbs of rules changed while stopped failed: retrying")
		if backoff.Sleep(ctx, delay) != nil {
			return
		}
	}
}

func (f *Follower) catchUp(ctx context.Context, since string) error {
	cur := since
	for {
		page, err := f.Couch.Changes(ctx, f.DB, couch.ChangesOptions{Since: cur, Limit: 1000})
		if err != nil {
			return fmt.Errorf("read rule changes since %q: %w", cur, err)
		}
		for _, c := range page.Results {
			if r, ok := f.Set.Rule(c.ID); ok && r.Enabled() && !f.added(ctx, r) {
				return ctx.Err()
			}
		}
		if len(page.Results) == 0 || page.LastSeq == cur {
			return nil
		}
		cur = page.LastSeq
	}
}

// Load reads every rule doc once and returns the seq to follow from.
func (f *Follower) Load(ctx context.Context) (string, error) {
	since := ""
	for {
		page, err := f.Couch.Changes(ctx, f.DB, couch.ChangesOptions{Since: since, IncludeDocs: true, Limit: 1000})
		if err != nil {
			if errors.Is(err, couch.ErrNotFound) {
				return "", fmt.Errorf("read rules: the spiegel db %q does not exist: run `producer install` first", f.DB)
			}
			return "", fmt.Errorf("read rules from %s: %w", f.DB, err)
		}
		for _, c := range page.Results {
			f.apply(ctx, c, false)
		}
		if len(page.Results) == 0 || page.LastSeq == since {
			f.report()
			f.setApplied(page.LastSeq)
			return page.LastSeq, nil
		}
		since = page.LastSeq
	}
}

// Follow applies rule changes from since until ctx ends; it never gives up on transient errors.
func (f *Follower) Follow(ctx context.Context, since string) {
	for attempt := 1; ; attempt++ {
		err := f.Couch.FollowChanges(ctx, f.DB, couch.ChangesOptions{Since: since, IncludeDocs: true}, func(c couch.Change) error {
			f.apply(ctx, c, true)
			f.report()
			since = c.Seq
			return nil
		})
		if ctx.Err() != nil {
			return
		}
		if f.Metrics != nil {
			f.Metrics.FeedError()
		}
		f.Log.WithError(err).WithField("attempt", attempt).Error("rule feed stopped, restarting")
		if backoff.Sleep(ctx, backoff.Default.Delay(attempt)) != nil {
			return
		}
	}
}

func (f *Follower) apply(ctx context.Context, c couch.Change, live bool) {
	if rules.IsServiceDocID(c.ID) {
		if live {
			f.setApplied(c.Seq)
		}
		return // the service's own docs: never rules, and they must not move EnqueuedSeq
	}
	ch, err := f.Set.Apply(c.ID, c.Doc, c.Deleted)
	if live {
		// The set reflects c now: jobs the OnAdded below publishes carry c.Seq, so a consumer
		// runs them only once its own set has this rule (Await).
		f.setApplied(c.Seq)
		if ch.Removed != nil && f.OnRemoved != nil {
			f.OnRemoved(ch.Removed, ch.Added)
		}
	}
	if err != nil {
		f.Log.WithField("rule", c.ID).WithError(err).Error("invalid rule skipped")
		if live {
			f.setEnqueued(c.Seq)
		}
		return
	}
	if ch.Added != nil && ch.Added.Enabled() {
		if live {
			f.Log.WithFields(logrus.Fields{"rule": c.ID, "kind": ch.Added.Kind()}).Info("rule added or changed")
		}
		if live && !f.added(ctx, ch.Added) {
			return // ctx ended: not recorded as enqueued, the next start catches up
		}
	}
	if live {
		f.setEnqueued(c.Seq)
	}
	if ch.Removed != nil && ch.Added == nil && live {
		f.Log.WithField("rule", c.ID).Info("rule removed")
	}
}

func (f *Follower) report() {
	if f.Metrics != nil {
		f.Metrics.RuleStats(f.Set.Stats())
	}
}
