package checkpoint

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// client returns a CouchDB client for url with the given request timeout (0: the default).
func client(t *testing.T, url string, timeout time.Duration) *couch.Client {
	t.Helper()
	c, err := couch.New(couch.Config{URL: url, RequestTimeout: timeout}, nil)
	require.NoError(t, err)
	return c
}

// TestStoreCallsEndAtTheRequestTimeout: a server that never answers does not hold a caller
// without a deadline of its own: every call ends at the client's request timeout.
func TestStoreCallsEndAtTheRequestTimeout(t *testing.T) {
	t.Parallel()
	stop := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-stop:
		}
	}))
	t.Cleanup(hung.Close)
	t.Cleanup(func() { close(stop) }) // runs first: the server's handlers return
	s := NewStore(client(t, hung.URL, 200*time.Millisecond), "spiegel")
	ctx := context.Background() // no deadline
	calls := map[string]func() error{
		"Position":       func() error { _, err := s.Position(ctx); return err },
		"SavePosition":   func() error { return s.SavePosition(ctx, Position{LastSeq: "1"}) },
		"OnChange":       func() error { _, err := s.OnChange(ctx, "r", "db"); return err },
		"SaveOnChange":   func() error { return s.SaveOnChange(ctx, OnChange{Rule: "r", DB: "db", LastSeq: "1"}) },
		"DeleteOnChange": func() error { return s.DeleteOnChange(ctx, "r", "db") },
	}
	for name, call := range calls {
		done := make(chan error, 1)
		go func() { done <- call() }()
		select {
		case err := <-done:
			assert.ErrorIs(t, err, context.DeadlineExceeded, name)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s still waits for the hung server after 10s", name)
		}
	}
}

func TestIDIsUnambiguous(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "spiegel_cp_hook_user_1", ID("hook", "user_1"))
	assert.NotEqual(t, ID("a_b", "c"), ID("a", "b_c"))
	assert.NotEqual(t, ID("a%5Fb", "c"), ID("a_b", "c"))
}

func TestStoreRoundTrip(t *testing.T) {
	srv := couchtest.Get(t)
	name := srv.NewDB(t, "cp_")
	s := NewStore(client(t, srv.URL, 0), name)
	ctx := t.Context()

	_, err := s.Position(ctx)
	require.ErrorIs(t, err, ErrNotFound)
	require.NoError(t, s.SavePosition(ctx, Position{LastSeq: "12-g1AAA", Source: "db_updates"}))
	require.NoError(t, s.SavePosition(ctx, Position{LastSeq: "13-g1AAA", Source: "db_updates"}))
	p, err := s.Position(ctx)
	require.NoError(t, err)
	assert.Equal(t, "13-g1AAA", p.LastSeq)

	require.NoError(t, s.SaveOnChange(ctx, OnChange{Rule: "hook_a", DB: "a/b+c$d", LastSeq: "7"}))
	cp, err := s.OnChange(ctx, "hook_a", "a/b+c$d")
	require.NoError(t, err)
	assert.Equal(t, "7", cp.LastSeq)
	require.NoError(t, s.DeleteDB(ctx, "a/b+c$d", []string{"hook_a", "other"}))
	_, err = s.OnChange(ctx, "hook_a", "a/b+c$d")
	assert.ErrorIs(t, err, ErrNotFound)
}

// Two stores writing the same doc (two producers) both succeed: conflicts are resolved.
func TestConcurrentWritersResolveConflicts(t *testing.T) {
	srv := couchtest.Get(t)
	name := srv.NewDB(t, "cp_")
	a, b := NewStore(client(t, srv.URL, 0), name), NewStore(client(t, srv.URL, 0), name)
	ctx := t.Context()
	for i := range 5 {
		require.NoError(t, a.SavePosition(ctx, Position{LastSeq: "a"}))
		require.NoError(t, b.SavePosition(ctx, Position{LastSeq: "b"}), "round %d", i)
	}
	p, err := a.Position(ctx)
	require.NoError(t, err)
	assert.Equal(t, "b", p.LastSeq)
	require.NoError(t, a.SaveOnChange(ctx, OnChange{Rule: "r", DB: "d", LastSeq: "1"}))
	require.NoError(t, a.DeleteOnChange(ctx, "r", "d"))
	require.NoError(t, a.SaveOnChange(ctx, OnChange{Rule: "r", DB: "d", LastSeq: "2"}), "write after delete")
}
