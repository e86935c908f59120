// Package rulefeed keeps a rules.Set in step with the spiegel db: a full load, then the db's
// continuous _changes feed, so that creating, editing and deleting a rule takes effect within
// seconds in every process.
package rulefeed

import (
	"context"
	"errors"
	"fmt"
	"sync"

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

// Follower follows the rule docs of one spiegel db into a rules.Set.
type Follower struct {
	Couch   *couch.Client
	DB      string
	Set     *rules.Set
	Log     logrus.FieldLogger
	Metrics Metrics
	// OnAdded is called, live, for every rule that is new or edited (may be nil). An error stops
	// the current pass; the rule is then not recorded as enqueued.
	OnAdded func(ctx context.Context, r rules.Rule) error

	mu sync.Mutex
	// enqueuedSeq is the spiegel db seq up to which onAdded has run for every change.
	enqueuedSeq string
}

// EnqueuedSeq returns the seq up to which new rules have had their dbs enqueued.
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

// CatchUp calls onAdded for every enabled rule changed after since ("" = every rule): the rules
// added or edited while no producer was running.
func (f *Follower) CatchUp(ctx context.Context, since, until string) error {
	cur := since
	for {
		page, err := f.Couch.Changes(ctx, f.DB, couch.ChangesOptions{Since: cur, Limit: 1000})
		if err != nil {
			return fmt.Errorf("read rule changes since %q: %w", cur, err)
		}
		for _, c := range page.Results {
			if r, ok := f.Set.Rule(c.ID); ok && r.Enabled() && f.OnAdded != nil {
				if err := f.OnAdded(ctx, r); err != nil {
					return err
				}
			}
		}
		if len(page.Results) == 0 || page.LastSeq == cur {
			break
		}
		cur = page.LastSeq
	}
	if until != "" {
		f.setEnqueued(until)
	}
	return nil
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
	ch, err := f.Set.Apply(c.ID, c.Doc, c.Deleted)
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
		if live && f.OnAdded != nil {
			if err := f.OnAdded(ctx, ch.Added); err != nil {
				return // not recorded as enqueued: the next start catches up
			}
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
