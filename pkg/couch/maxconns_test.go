package couch

import (
	"context"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// TestMaxConnsCapsRequestsNotFeeds: with Config.MaxConns 2, 12 requests that each hold their
// connection for 300 ms (longpoll _changes that time out) go over at most 2 connections, while a
// continuous feed opened before them keeps its own connection and still delivers a change.
// Without the cap each request would open a connection of its own.
func TestMaxConnsCapsRequestsNotFeeds(t *testing.T) {
	srv := couchtest.Get(t)
	db := srv.NewDB(t, "maxconns")
	proxy := srv.NewProxy(t)
	l, _ := testLogger()
	c, err := New(Config{URL: proxy.URL(srv.URL), RequestTimeout: 30 * time.Second, MaxConns: 2}, l)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	connected := make(chan struct{})
	changes := make(chan Change, 16)
	feedCtx, stopFeed := context.WithCancel(ctx)
	defer stopFeed()
	go func() {
		_ = c.WatchChanges(feedCtx, db, ChangesOptions{Heartbeat: time.Second}, func() { close(connected) }, func(ch Change) error {
			changes <- ch
			return nil
		})
	}()
	select {
	case <-connected:
	case <-ctx.Done():
		t.Fatal("the continuous feed did not connect")
	}

	const requests = 12
	var wg sync.WaitGroup
	errs := make(chan error, requests)
	for range requests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			q := url.Values{"feed": {"longpoll"}, "timeout": {"300"}, "since": {"now"}}
			errs <- c.Do(ctx, http.MethodGet, c.DBPath(db)+"/_changes", q, nil, nil)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	assert.LessOrEqual(t, proxy.Peak(), 3, "2 connections for requests and 1 for the feed")

	srv.Put(t, db, "after", map[string]any{"n": 1})
	select {
	case ch := <-changes:
		assert.Equal(t, "after", ch.ID)
	case <-ctx.Done():
		t.Fatal("the feed delivered no change while requests were capped")
	}
}

// TestMaxConnsZeroIsUncapped: the same requests without a cap open more connections than the
// capped client's two (the control of the test above).
func TestMaxConnsZeroIsUncapped(t *testing.T) {
	srv := couchtest.Get(t)
	db := srv.NewDB(t, "maxconns0")
	proxy := srv.NewProxy(t)
	l, _ := testLogger()
	c, err := New(Config{URL: proxy.URL(srv.URL), RequestTimeout: 30 * time.Second}, l)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			q := url.Values{"feed": {"longpoll"}, "timeout": {"1000"}, "since": {"now"}}
			assert.NoError(t, c.Do(ctx, http.MethodGet, c.DBPath(db)+"/_changes", q, nil, nil))
		}()
	}
	wg.Wait()
	assert.Greater(t, proxy.Peak(), 2)
}
