package couchtest_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

var errFollowed = errors.New("followed far enough")

// follow runs feed from since until done holds for the events emitted so far, and returns them.
func follow(t *testing.T, feed couch.UpdatesFeed, since string, done func([]couch.DBEvent) bool) []couch.DBEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitLimit)
	defer cancel()
	var evs []couch.DBEvent
	err := feed.Run(ctx, since, func(ev couch.DBEvent) error {
		evs = append(evs, ev)
		if done(evs) {
			return errFollowed
		}
		return nil
	})
	require.ErrorIs(t, err, errFollowed, "the feed from %s ended before the test was satisfied; events: %+v", since, evs)
	return evs
}

// eventTypes returns the types of db's events, in feed order.
func eventTypes(evs []couch.DBEvent, db string) []string {
	var types []string
	for _, ev := range evs {
		if ev.DB == db {
			types = append(types, ev.Type)
		}
	}
	return types
}

// sawCreatedAndUpdated holds once evs hold created and updated events of each of dbs.
func sawCreatedAndUpdated(dbs ...string) func([]couch.DBEvent) bool {
	return func(evs []couch.DBEvent) bool {
		for _, db := range dbs {
			types := eventTypes(evs, db)
			if !slices.Contains(types, "created") || !slices.Contains(types, "updated") {
				return false
			}
		}
		return true
	}
}

func TestUpdatesProxyServesTheProducersFeedWithRealPositions(t *testing.T) {
	t.Parallel()
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		c, err := couch.New(couch.Config{URL: p.URL()}, nil)
		require.NoError(t, err)
		prefix := couchtest.UniqueName(t, "pf")
		feed, err := c.NewUpdatesFeed(t.Context(), couch.SourceAuto, couch.FeedOptions{
			Heartbeat: 300 * time.Millisecond,
			Match:     func(db string) bool { return strings.HasPrefix(db, prefix) },
		})
		require.NoError(t, err)
		require.Equal(t, couch.SourceDBUpdates, feed.Source(), "not the poll source, which has no positions")

		start := readUpdates(t, p, "feed=normal&since=now").LastSeq
		ps := p.Server()
		a, b := prefix+"_a", prefix+"_b"
		ps.CreateDB(t, a)
		ps.Put(t, a, "doc", map[string]int{"a": 1})
		first := follow(t, feed, start, sawCreatedAndUpdated(a))
		for _, ev := range first {
			assert.Regexp(t, seqShape, ev.Seq, "event %+v", ev)
		}
		saved := first[len(first)-1].Seq

		ps.CreateDB(t, b)
		ps.Put(t, b, "doc", map[string]int{"b": 1})
		resumed := follow(t, feed, saved, sawCreatedAndUpdated(b))
		if !p.Synthetic() && ps.Cluster {
			// Each node of a cluster reports the update of its own copy of a, in its own time.
			t.Logf("events of %s after %s (a cluster): %v", a, saved, eventTypes(resumed, a))
		} else {
			assert.Empty(t, eventTypes(resumed, a), "resuming from %s repeats %s: %+v", saved, a, resumed)
		}

		// CouchDB merges the shards of its feed in no set order: wait for both dbs.
		replayed := follow(t, feed, start, sawCreatedAndUpdated(a, b))
		assert.ElementsMatch(t, []string{"created", "updated"}, eventTypes(replayed, a),
			"an earlier position replays %s once: %+v", a, replayed)
	})
}
