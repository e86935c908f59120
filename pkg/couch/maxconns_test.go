package couch

import (
	"context"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// proxiedClient returns the test server, a new db on it, a proxy counting the connections to
// it and a client through that proxy capped at maxConns.
func proxiedClient(t *testing.T, dbName string, maxConns int) (*couchtest.Server, string, *couchtest.Proxy, *Client) {
	t.Helper()
	srv := couchtest.Get(t)
	db := srv.NewDB(t, dbName)
	proxy := srv.NewProxy(t)
	l, _ := testLogger()
	c, err := New(Config{URL: proxy.URL(srv.URL), RequestTimeout: 30 * time.Second, MaxConns: maxConns}, l)
	require.NoError(t, err)
	return srv, db, proxy, c
}

// openFeed follows db's continuous feed until ctx ends and returns its changes once it is
// connected.
func openFeed(t *testing.T, ctx context.Context, c *Client, db string) <-chan Change {
	t.Helper()
	connected := make(chan struct{})
	changes := make(chan Change, 16)
	go func() {
		_ = c.WatchChanges(ctx, db, ChangesOptions{Heartbeat: time.Second}, func() { close(connected) }, func(ch Change) error {
			changes <- ch
			return nil
		})
	}()
	select {
	case <-connected:
	case <-ctx.Done():
		t.Fatal("the continuous feed did not connect")
	}
	return changes
}

// heldRequests starts n POSTs of an empty _bulk_docs to db whose bodies are written only when
// release is closed: each holds its connection until then. wait returns their errors.
func heldRequests(ctx context.Context, c *Client, db string, n int, release <-chan struct{}) (wait func() []error) {
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		pr, pw := io.Pipe()
		go func() {
			<-release
			_, _ = pw.Write([]byte(`{"docs":[]}`))
			_ = pw.Close()
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.Do(ctx, http.MethodPost, c.DBPath(db)+"/_bulk_docs", nil, pr, nil)
		}()
	}
	return func() []error { wg.Wait(); return errs }
}

// TestMaxConnsCapsRequestsNotFeeds: with Config.MaxConns 2, 12 requests that hold their
// connections (their bodies not yet sent) get two connections between them, while a continuous
// feed opened before them keeps its own and still delivers a change; once released, every
// request succeeds. Without the cap each request holds a connection of its own (see
// TestMaxConnsZeroIsUncapped).
func TestMaxConnsCapsRequestsNotFeeds(t *testing.T) {
	srv, db, proxy, c := proxiedClient(t, "maxconns", 2)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	feedCtx, stopFeed := context.WithCancel(ctx)
	defer stopFeed()
	changes := openFeed(t, feedCtx, c, db)

	release := make(chan struct{})
	wait := heldRequests(ctx, c, db, 12, release)
	require.Eventually(t, func() bool { return proxy.Open() >= 3 }, 20*time.Second, 10*time.Millisecond,
		"two held requests and the feed")
	assert.Never(t, func() bool { return proxy.Open() > 3 }, 500*time.Millisecond, 10*time.Millisecond,
		"a third request got a connection of its own")
	srv.Put(t, db, "while-held", map[string]any{"n": 1})
	select {
	case ch := <-changes:
		assert.Equal(t, "while-held", ch.ID)
	case <-ctx.Done():
		t.Fatal("the feed delivered no change while requests held every capped connection")
	}
	close(release)
	for _, err := range wait() {
		require.NoError(t, err)
	}
	assert.LessOrEqual(t, proxy.Peak(), 3, "2 connections for requests and 1 for the feed")
}

// TestMaxConnsZeroIsUncapped: the same held requests without a cap open a connection each (the
// control of the test above).
func TestMaxConnsZeroIsUncapped(t *testing.T) {
	_, db, proxy, c := proxiedClient(t, "maxconns0", 0)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	release := make(chan struct{})
	wait := heldRequests(ctx, c, db, 12, release)
	assert.Eventually(t, func() bool { return proxy.Open() >= 12 }, 20*time.Second, 10*time.Millisecond)
	close(release)
	for _, err := range wait() {
		require.NoError(t, err)
	}
}

// TestCloseIdleConnectionsKeepsFeeds: after a burst of 6 requests the pool keeps their 6
// connections idle; CloseIdleConnections closes them, while a continuous feed keeps its own
// and still delivers, and the next request opens one again.
func TestCloseIdleConnectionsKeepsFeeds(t *testing.T) {
	srv, db, proxy, c := proxiedClient(t, "closeidle", 0)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	changes := openFeed(t, ctx, c, db)

	release := make(chan struct{})
	wait := heldRequests(ctx, c, db, 6, release)
	require.Eventually(t, func() bool { return proxy.Open() >= 7 }, 20*time.Second, 10*time.Millisecond, "six held requests and the feed")
	close(release)
	for _, err := range wait() {
		require.NoError(t, err)
	}
	assert.Equal(t, 7, proxy.Open(), "the burst's connections stay open, idle")

	// Within less than the server's own idle timeout (PouchDB Server's is 5 s): the client closes
	// them, through every transport wrapper.
	c.CloseIdleConnections()
	require.Eventually(t, func() bool { return proxy.Open() == 1 }, 3*time.Second, 10*time.Millisecond, "only the feed's connection is left")
	srv.Put(t, db, "after-close", map[string]any{"n": 1})
	select {
	case ch := <-changes:
		assert.Equal(t, "after-close", ch.ID)
	case <-ctx.Done():
		t.Fatal("the feed delivered nothing after the idle connections were closed")
	}
	_, err := c.DBInfo(ctx, db)
	require.NoError(t, err)
}
