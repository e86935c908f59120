package rulefeed

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// added records OnAdded calls and fails the first failures[id] of each rule.
type added struct {
	mu       sync.Mutex
	calls    []string
	failures map[string]int
}

func (a *added) onAdded(_ context.Context, r rules.Rule) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, r.ID())
	if a.failures[r.ID()] > 0 {
		a.failures[r.ID()]--
		return errors.New("enqueue failed")
	}
	return nil
}

func (a *added) list() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.calls...)
}

func newFollower(t *testing.T, srv *couchtest.Server, db string, a *added) *Follower {
	t.Helper()
	c, err := couch.New(couch.Config{URL: srv.URL}, nil)
	require.NoError(t, err)
	log := logrus.New()
	log.SetOutput(io.Discard)
	return &Follower{Couch: c, DB: db, Set: rules.NewSet(), Log: log, OnAdded: a.onAdded,
		Retry: backoff.Policy{Initial: time.Millisecond, Max: 5 * time.Millisecond, Multiplier: 2}}
}

// withoutRules drops the ids of rule docs (r1, r2, ...).
func withoutRules(ids []string) []string {
	var out []string
	for _, id := range ids {
		if len(id) > 1 && id[0] == 'r' && id[1] >= '0' && id[1] <= '9' {
			continue
		}
		out = append(out, id)
	}
	return out
}

func rule(db string) map[string]any {
	return map[string]any{"type": "replicator", "source": db, "target": db + "_copy"}
}

// spiegelSeq returns db's current update_seq.
func spiegelSeq(t *testing.T, f *Follower) string {
	t.Helper()
	info, err := f.Couch.DBInfo(t.Context(), f.DB)
	require.NoError(t, err)
	return info.UpdateSeq
}

// changedSince returns the ids of the docs changed after seq (seqs are opaque: this is how a
// test tells where a seq is).
func changedSince(t *testing.T, f *Follower, seq string) []string {
	t.Helper()
	page, err := f.Couch.Changes(t.Context(), f.DB, couch.ChangesOptions{Since: seq})
	require.NoError(t, err)
	var ids []string
	for _, c := range page.Results {
		ids = append(ids, c.ID)
	}
	return ids
}

// follow runs f.Follow until the test ends.
func follow(t *testing.T, f *Follower, since string) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Follow(ctx, since) }()
	t.Cleanup(func() { cancel(); <-done })
}

// TestFollowAppliesLiveChanges: a rule added, edited, made invalid and deleted takes effect;
// OnAdded runs for each valid version; EnqueuedSeq moves for rule docs only, never for the
// service's own docs, and only after OnAdded succeeded (a failure is retried).
func TestFollowAppliesLiveChanges(t *testing.T) {
	srv := couchtest.Get(t)
	db := srv.NewDB(t, "rulefeed_")
	a := &added{failures: map[string]int{"r1": 2}}
	f := newFollower(t, srv, db, a)
	since, err := f.Load(t.Context())
	require.NoError(t, err)
	follow(t, f, since)

	srv.Put(t, db, "r1", rule("a"))
	require.Eventually(t, func() bool { _, ok := f.Set.Rule("r1"); return ok && f.EnqueuedSeq() != "" }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, []string{"r1", "r1", "r1"}, a.list(), "OnAdded retried until it succeeded")
	afterR1 := f.EnqueuedSeq()

	// The service's own docs never move it.
	srv.Put(t, db, "spiegel_producer_seq", map[string]any{"last_seq": "1"})
	srv.Put(t, db, "spiegel_cp_r1_a", map[string]any{"last_seq": "1"})
	srv.Put(t, db, "r2", rule("b"))
	require.Eventually(t, func() bool { _, ok := f.Set.Rule("r2"); return ok && f.EnqueuedSeq() != afterR1 }, 10*time.Second, 5*time.Millisecond)
	assert.ElementsMatch(t, []string{"spiegel_producer_seq", "spiegel_cp_r1_a"}, withoutRules(changedSince(t, f, afterR1)),
		"the changes between r1 and r2: service docs")
	assert.NotContains(t, changedSince(t, f, f.EnqueuedSeq()), "r2", "EnqueuedSeq is at r2")
	afterR2 := f.EnqueuedSeq()
	var pos map[string]any
	require.NoError(t, srv.Do(t, http.MethodGet, "/"+couchtest.PathDB(db)+"/spiegel_producer_seq", nil, &pos))
	srv.Put(t, db, "spiegel_producer_seq", map[string]any{"last_seq": "2", "_rev": pos["_rev"]})
	require.Never(t, func() bool { return f.EnqueuedSeq() != afterR2 }, 300*time.Millisecond, 10*time.Millisecond,
		"a service doc moved EnqueuedSeq")

	// An invalid edit removes the rule and counts as handled; a delete removes it too.
	var r2 map[string]any
	require.NoError(t, srv.Do(t, http.MethodGet, "/"+couchtest.PathDB(db)+"/r2", nil, &r2))
	rev := srv.Put(t, db, "r2", map[string]any{"type": "replicator", "_rev": r2["_rev"]})
	require.Eventually(t, func() bool { _, ok := f.Set.Rule("r2"); return !ok }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, 1, f.Set.Stats().Rejected)
	require.NoError(t, srv.Do(t, http.MethodDelete, "/"+couchtest.PathDB(db)+"/r2?rev="+rev, nil, nil))
	require.Eventually(t, func() bool { return len(changedSince(t, f, f.EnqueuedSeq())) == 0 }, 10*time.Second, 5*time.Millisecond,
		"EnqueuedSeq reaches the last change, r2's deletion")
	assert.Equal(t, []string{"r1", "r1", "r1", "r2"}, a.list())
}

// TestCatchUp: the rules changed after a saved rules seq are handed to OnAdded, a failed pass is
// retried, and EnqueuedSeq becomes the seq loaded only once every one of them succeeded.
func TestCatchUp(t *testing.T) {
	srv := couchtest.Get(t)
	db := srv.NewDB(t, "rulefeed_")
	srv.Put(t, db, "old", rule("a"))
	a := &added{failures: map[string]int{"new": 1}}
	f := newFollower(t, srv, db, a)
	saved := spiegelSeq(t, f)
	srv.Put(t, db, "new", rule("b"))
	srv.Put(t, db, "disabled", map[string]any{"type": "replicator", "source": "c", "target": "d", "disabled": true})
	srv.Put(t, db, "spiegel_producer_seq", map[string]any{"last_seq": "1"})
	until, err := f.Load(t.Context())
	require.NoError(t, err)
	assert.Empty(t, f.EnqueuedSeq())

	f.CatchUp(t.Context(), saved, until)
	assert.Equal(t, []string{"new", "new"}, a.list(), "only the enabled rule changed after the saved seq, retried once")
	assert.Equal(t, until, f.EnqueuedSeq())

	// From the beginning: every enabled rule.
	b := &added{}
	g := newFollower(t, srv, db, b)
	until, err = g.Load(t.Context())
	require.NoError(t, err)
	g.CatchUp(t.Context(), "", until)
	assert.ElementsMatch(t, []string{"old", "new"}, b.list())
}

// TestCatchUpStopsWithItsContext: a pass that keeps failing ends with its context, and the
// rules seq is not recorded.
func TestCatchUpStopsWithItsContext(t *testing.T) {
	srv := couchtest.Get(t)
	db := srv.NewDB(t, "rulefeed_")
	srv.Put(t, db, "r", rule("a"))
	a := &added{failures: map[string]int{"r": 1 << 30}}
	f := newFollower(t, srv, db, a)
	until, err := f.Load(t.Context())
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	f.CatchUp(ctx, "", until)
	assert.Empty(t, f.EnqueuedSeq())
	assert.Greater(t, len(a.list()), 2, "retried while the context lasted")
}
