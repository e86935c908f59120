package couch

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// One state of one db (five docs) on the three-node CouchDB 3.5.2 cluster (n=3, q=2): GET /{db}
// through one node, three answers, three different strings. A _changes read since any of them
// has no row; after a sixth write, each has one.
var clusterCopies = []string{
	"5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMBuapFoaWCWjKkLp0mJDEn1UCNYwEYkJhkkmSeaYirPAgAhXCRx",
	"5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV2MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMBukZSYlpyWjKkLp0mJDEn1UCNYwEZYppmnmJmbYCrPAgBfXCTv",
	"5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMCeZGBhkWphjKkLbpIhmkmJDEn1UCNYwEYkJhkkmSeaYirPAgAjiSR1",
}

// clusterNode answers as a node of a CouchDB cluster does for one quiet db: each db info names
// another string for the same state (the recorded clusterCopies, in turn), and a _changes read since any of
// them has no row until written is set. No real server in the test setup answers this way:
// PouchDB Server and a single node always name the same copies.
type clusterNode struct {
	*httptest.Server
	written atomic.Bool
	mu      sync.Mutex
	infos   int
	asked   []string // the since of each _changes read
}

func newClusterNode(t *testing.T) *clusterNode {
	n := &clusterNode{}
	n.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		n.mu.Lock()
		defer n.mu.Unlock()
		switch r.URL.Path {
		case "/_all_dbs":
			_ = json.NewEncoder(w).Encode([]string{"userdb"})
		case "/_dbs_info":
			seq := clusterCopies[n.infos%len(clusterCopies)]
			n.infos++
			_ = json.NewEncoder(w).Encode([]map[string]any{{"key": "userdb", "info": map[string]any{"db_name": "userdb", "update_seq": seq}}})
		case "/userdb/_changes":
			since := r.URL.Query().Get("since")
			n.asked = append(n.asked, since)
			results := []map[string]any{}
			if n.written.Load() {
				results = append(results, map[string]any{"seq": "6-x", "id": "d6", "changes": []map[string]string{{"rev": "1-a"}}})
			}
			_ = json.NewEncoder(w).Encode(map[string]any{"results": results, "last_seq": since})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(n.Close)
	return n
}

// The poll source on a cluster: a db whose update_seq names other copies each round, with no
// change, gives no updated event (one _changes read since the previous seq says so); a write
// gives one.
func TestPollOnAClusterAsksBeforeReportingAnUpdate(t *testing.T) {
	n := newClusterNode(t)
	c, _ := newTestClient(t, n.URL)
	feed, err := c.NewUpdatesFeed(t.Context(), SourcePoll, FeedOptions{PollInterval: 5 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var got collector[DBEvent]
	done := runAsync(func() error { return feed.Run(ctx, SinceNow, got.emit) })
	rounds := func() int { n.mu.Lock(); defer n.mu.Unlock(); return n.infos }
	require.Eventually(t, func() bool { return rounds() >= 7 }, 10*time.Second, 5*time.Millisecond)
	assert.Empty(t, got.get(), "rounds of other copies, no change: no event")
	n.mu.Lock()
	asked := append([]string(nil), n.asked...)
	n.mu.Unlock()
	require.NotEmpty(t, asked)
	assert.Equal(t, clusterCopies[0], asked[0], "asked since the baseline's seq")

	n.written.Store(true)
	require.Eventually(t, func() bool { return len(got.get()) > 0 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, DBEvent{DB: "userdb", Type: EventUpdated, Seq: PollSeq}, got.get()[0])
	cancel()
	require.ErrorIs(t, waitDone(t, done), context.Canceled)
}
