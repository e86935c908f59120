package checkpoint

import (
	"context"
	"fmt"
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
	c := client(t, hung.URL, 200*time.Millisecond)
	s, oc := NewStore(c, "spiegel"), NewOnChangeStore(c, nil)
	ctx := context.Background() // no deadline
	calls := map[string]func() error{
		"Position":     func() error { _, err := s.Position(ctx); return err },
		"SavePosition": func() error { return s.SavePosition(ctx, Position{LastSeq: "1"}) },
		"Load":         func() error { _, err := oc.Load(ctx, "r", "db"); return err },
		"Save":         func() error { return oc.Save(ctx, &OnChangePoint{Rule: "r", DB: "db"}, "1") },
		"Reset":        func() error { return oc.Reset(ctx, "r", "db", "") },
		"Delete":       func() error { return oc.Delete(ctx, "r", "db") },
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
	if srv.Cluster {
		// A write with a rev one copy has not seen yet lands there as a sibling: the doc may
		// end with both writers' revisions as conflicting leaves, and CouchDB's pick of a
		// winner need not be the last write. (Several producers at once only repeat events.)
		assert.Contains(t, []string{"a", "b"}, p.LastSeq)
		return
	}
	assert.Equal(t, "b", p.LastSeq)
}

// TestMigrateLegacy: checkpoints an earlier release kept in the spiegel db move to _local docs in
// their dbs and leave the spiegel db; those of dbs that are gone are dropped.
func TestMigrateLegacy(t *testing.T) {
	srv := couchtest.Get(t)
	spiegel := srv.NewDB(t, "cp_spiegel_")
	live := srv.NewDB(t, "cp_live+x_")
	srv.Put(t, live, "d", map[string]any{"x": 1})
	var info struct {
		Seq      any    `json:"update_seq"`
		Instance string `json:"instance_start_time"`
	}
	require.NoError(t, srv.Do(t, "GET", "/"+couchtest.PathDB(live), nil, &info))
	seq := fmt.Sprint(info.Seq)
	srv.Put(t, spiegel, ID("hook_a", live), map[string]any{"rule": "hook_a", "db": live, "last_seq": seq, "db_instance": info.Instance})
	srv.Put(t, spiegel, ID("hook_a", live+"_gone"), map[string]any{"rule": "hook_a", "db": live + "_gone", "last_seq": "3"})
	srv.Put(t, spiegel, "a_rule", map[string]any{"type": "on_change", "url": "http://h/"})

	s := NewOnChangeStore(client(t, srv.URL, 0), nil)
	n, err := s.MigrateLegacy(t.Context(), spiegel)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	p, err := s.Load(t.Context(), "hook_a", live)
	require.NoError(t, err)
	assert.True(t, p.Found)
	assert.Equal(t, seq, p.LastSeq)
	var all struct {
		Rows []struct {
			ID string `json:"id"`
		} `json:"rows"`
	}
	require.NoError(t, srv.Do(t, "GET", "/"+couchtest.PathDB(spiegel)+"/_all_docs", nil, &all))
	require.Len(t, all.Rows, 1, "the old checkpoints are gone from the spiegel db")
	assert.Equal(t, "a_rule", all.Rows[0].ID)

	n, err = s.MigrateLegacy(t.Context(), spiegel)
	require.NoError(t, err)
	assert.Zero(t, n, "nothing left to move")
}
