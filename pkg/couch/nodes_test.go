package couch

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

func TestSplitURLs(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"http://a:5984", []string{"http://a:5984"}},
		{"http://u:p@a:5984,http://b:5984", []string{"http://u:p@a:5984", "http://b:5984"}},
		{"http://u:p@a:5984, https://b:6984 ,HTTP://c", []string{"http://u:p@a:5984", "https://b:6984", "HTTP://c"}},
		{"http://u:p,w@a:5984", []string{"http://u:p,w@a:5984"}}, // a comma in the password
		{"http://u:p,w@a:5984,http://u:p,w@b:5984", []string{"http://u:p,w@a:5984", "http://u:p,w@b:5984"}},
	} {
		assert.Equal(t, tc.want, SplitURLs(tc.in), tc.in)
	}
}

func TestNodeListErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"http://u:secret@a:5984,http://b:5984/prefix", "a node's path must be the first URL's"},
		{"http://u:secret@a:5984,http://v:other@b:5984", "a node's credentials must be the first URL's"},
		{"http://u:secret@a:5984,http://u:secret@a:5984", "node listed twice"},
		{"http://u:secret@a:5984,http://", "no host"},
	} {
		_, err := New(Config{URL: tc.in}, nil)
		require.Error(t, err, tc.in)
		assert.Contains(t, err.Error(), tc.want)
		assert.NotContains(t, err.Error(), "secret")
		assert.NotContains(t, err.Error(), "other")
	}
	c, err := New(Config{URL: "http://u:secret@a:5984,http://u:secret@b:5984,http://c:5984"}, nil)
	require.NoError(t, err)
	assert.Equal(t, "http://u:xxxxx@a:5984,http://u:xxxxx@b:5984,http://c:5984", c.Redacted())
	assert.Equal(t, "a:5984", c.NodeInUse())
}

// TestFailoverToNextNode: a client given two nodes (two proxies in front of one server) uses the
// first; when it becomes unreachable, a request — a POST too, since it never reached the node —
// goes to the second in the same call, and a continuous feed opened on the first reconnects to
// the second and delivers what was written meanwhile. It sticks to the second until that one
// fails, and then goes back to the first.
func TestFailoverToNextNode(t *testing.T) {
	srv := couchtest.Get(t)
	db := srv.NewDB(t, "failover")
	p1, p2 := srv.NewProxy(t), srv.NewProxy(t)
	u2, _ := url.Parse(p2.URL(srv.URL))
	u2.User = nil // the first URL's credentials apply
	l, logs := testLogger()
	c, err := New(Config{URL: p1.URL(srv.URL) + "," + u2.String(), RequestTimeout: 10 * time.Second}, l)
	require.NoError(t, err)
	c.retry = fastRetry
	host1, _ := url.Parse(p1.URL(srv.URL))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	_, err = c.DBInfo(ctx, db)
	require.NoError(t, err)
	assert.Equal(t, host1.Host, c.NodeInUse())

	changes := make(chan Change, 16)
	go func() {
		_ = c.FollowChanges(ctx, db, ChangesOptions{Since: SinceNow, Heartbeat: time.Second}, func(ch Change) error {
			changes <- ch
			return nil
		})
	}()
	srv.Put(t, db, "on-first", map[string]any{"n": 1})
	requireChange(t, ctx, changes, "on-first")

	p1.Cut()
	var created struct {
		ID string `json:"id"`
	}
	require.NoError(t, c.Do(ctx, http.MethodPost, c.DBPath(db), nil, map[string]any{"n": 2}, &created))
	assert.Equal(t, u2.Host, c.NodeInUse())
	assert.Contains(t, logs.String(), "using the next node")
	if pw, ok := host1.User.Password(); ok {
		assert.NotContains(t, logs.String(), pw, "no password in the log")
	}
	srv.Put(t, db, "on-second", map[string]any{"n": 3})
	requireChange(t, ctx, changes, created.ID, "on-second")

	p1.Restore(t)
	_, err = c.DBInfo(ctx, db)
	require.NoError(t, err)
	assert.Equal(t, u2.Host, c.NodeInUse(), "sticks to the node that answers")
	p2.Cut()
	_, err = c.DBInfo(ctx, db)
	require.NoError(t, err)
	assert.Equal(t, host1.Host, c.NodeInUse())
}

// requireChange waits until the changes of every id arrived (others are skipped).
func requireChange(t *testing.T, ctx context.Context, changes <-chan Change, ids ...string) {
	t.Helper()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	for len(want) > 0 {
		select {
		case ch := <-changes:
			delete(want, ch.ID)
		case <-ctx.Done():
			t.Fatalf("changes of %s never arrived", strings.Join(ids, ", "))
		}
	}
}
