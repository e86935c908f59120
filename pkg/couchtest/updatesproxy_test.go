package couchtest_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// seqShape is the shape of CouchDB 3's seqs, which the proxy imitates.
var seqShape = regexp.MustCompile(`^[0-9]+-g1AAAA[A-Za-z0-9_-]+$`)

// waitLimit bounds every wait for a feed row; CouchDB's own coalescing takes up to ~0.5 s.
const waitLimit = 20 * time.Second

type dbUpdate struct {
	DBName string `json:"db_name"`
	Type   string `json:"type"`
	Seq    string `json:"seq"` // a JSON number fails to decode: seqs must be strings
}

type dbUpdates struct {
	Results []dbUpdate `json:"results"`
	LastSeq string     `json:"last_seq"`
}

// eachMode runs fn against a default proxy and, where the server has its own _db_updates (so the
// default proxy passes it through), against a proxy that synthesizes it anyway.
func eachMode(t *testing.T, opts []couchtest.UpdatesProxyOption, fn func(t *testing.T, p *couchtest.UpdatesProxy)) {
	s := couchtest.Get(t)
	t.Run("default", func(t *testing.T) {
		t.Parallel()
		fn(t, s.NewUpdatesProxy(t, opts...))
	})
	if !s.PouchDB {
		t.Run("synthetic", func(t *testing.T) {
			t.Parallel()
			fn(t, s.NewUpdatesProxy(t, append(slices.Clone(opts), couchtest.AlwaysSynthesize())...))
		})
	}
}

// get sends GET path?query through the proxy and returns the status and body.
func get(t *testing.T, p *couchtest.UpdatesProxy, path string) (int, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitLimit)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL()+path, nil)
	require.NoError(t, err)
	resp, err := p.Server().HTTP.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, body
}

// readUpdates reads /_db_updates?query through the proxy; it must answer 200.
func readUpdates(t *testing.T, p *couchtest.UpdatesProxy, query string) dbUpdates {
	t.Helper()
	status, body := get(t, p, "/_db_updates?"+query)
	require.Equal(t, http.StatusOK, status, "GET /_db_updates?%s: %s", query, body)
	var u dbUpdates
	require.NoError(t, json.Unmarshal(body, &u), "decode %s", body)
	require.Regexp(t, seqShape, u.LastSeq)
	for _, r := range u.Results {
		require.Regexp(t, seqShape, r.Seq, "row %+v", r)
	}
	return u
}

// waitRows follows the feed from since with longpoll requests until done holds for the rows read
// so far (in feed order), and returns them with the last_seq after them.
func waitRows(t *testing.T, p *couchtest.UpdatesProxy, since string, done func([]dbUpdate) bool) ([]dbUpdate, string) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	var rows []dbUpdate
	for !done(rows) {
		if time.Now().After(deadline) {
			t.Fatalf("feed rows after %s never satisfied the test; rows read: %+v", since, rows)
		}
		u := readUpdates(t, p, "feed=longpoll&timeout=1000&since="+since)
		rows, since = append(rows, u.Results...), u.LastSeq
	}
	return rows, since
}

// typesOf returns the types of db's rows, in feed order.
func typesOf(rows []dbUpdate, db string) []string {
	var types []string
	for _, r := range rows {
		if r.DBName == db {
			types = append(types, r.Type)
		}
	}
	return types
}

// hasRows holds once the rows hold a row of db of each of types.
func hasRows(db string, types ...string) func([]dbUpdate) bool {
	return func(rows []dbUpdate) bool {
		seen := typesOf(rows, db)
		for _, typ := range types {
			if !slices.Contains(seen, typ) {
				return false
			}
		}
		return true
	}
}

func TestUpdatesProxySynthesizesOnlyWhereTheServerLacksDBUpdates(t *testing.T) {
	t.Parallel()
	s := couchtest.Get(t)
	p := s.NewUpdatesProxy(t)
	assert.Equal(t, s.PouchDB, p.Synthetic(), "PouchDB Server has no _db_updates, CouchDB has")
	assert.True(t, s.NewUpdatesProxy(t, couchtest.AlwaysSynthesize()).Synthetic())
	status, body := get(t, p, "/_db_updates?feed=normal&limit=1")
	assert.Equal(t, http.StatusOK, status, "the proxy has _db_updates on every server: %s", body)
}

func TestUpdatesProxyReportsCreatedUpdatedDeleted(t *testing.T) {
	t.Parallel()
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		start := readUpdates(t, p, "feed=normal&since=now").LastSeq
		ps := p.Server()
		db := couchtest.UniqueName(t, "up")
		ps.CreateDB(t, db)
		ps.Put(t, db, "doc", map[string]int{"a": 1})
		require.NoError(t, ps.Client.DestroyDB(t.Context(), db))

		rows, _ := waitRows(t, p, start, hasRows(db, "created", "updated", "deleted"))
		types := typesOf(rows, db)
		// CouchDB writes the rows of one coalescing window in no particular order; the proxy in
		// the order of the writes.
		assert.ElementsMatch(t, []string{"created", "updated", "deleted"}, types, "rows of %s", db)
		if p.Synthetic() {
			assert.Equal(t, []string{"created", "updated", "deleted"}, types, "rows of %s", db)
		}
		assert.GreaterOrEqual(t, p.Writes(), 3)
	})
}

func TestUpdatesProxyResumesFromLastSeqWithoutRepeating(t *testing.T) {
	t.Parallel()
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		start := readUpdates(t, p, "feed=normal&since=now").LastSeq
		ps := p.Server()
		db1, db2 := couchtest.UniqueName(t, "r1"), couchtest.UniqueName(t, "r2")
		ps.CreateDB(t, db1)
		ps.Put(t, db1, "doc", map[string]int{"a": 1})
		// CouchDB writes the rows of one window in any order: wait for both.
		_, last := waitRows(t, p, start, hasRows(db1, "created", "updated"))

		ps.CreateDB(t, db2)
		ps.Put(t, db2, "doc", map[string]int{"a": 1})
		rows, _ := waitRows(t, p, last, hasRows(db2, "created", "updated"))
		if !p.Synthetic() && ps.Cluster {
			// Each node of a cluster reports the update of its own copy of db1, in its own time:
			// a row of db1 may come again later.
			t.Logf("rows of %s after %s (a cluster): %v", db1, last, typesOf(rows, db1))
		} else {
			assert.Empty(t, typesOf(rows, db1), "rows after %s repeat %s: %+v", last, db1, rows)
		}

		again := readUpdates(t, p, "feed=normal&since="+start).Results
		assert.Contains(t, typesOf(again, db1), "created", "since=start still holds db1")
		assert.Contains(t, typesOf(again, db2), "created", "since=start holds db2")
	})
}

// openFeed opens GET path (with its query) through the proxy and sends the non-blank lines of the
// answer to the returned channel, which is closed when the stream ends. The request ends with
// the test.
func openFeed(t *testing.T, p *couchtest.UpdatesProxy, path string) <-chan string {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL()+path, nil)
	require.NoError(t, err)
	resp, err := p.Server().HTTP.Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	lines := make(chan string)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(lines)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if line := strings.TrimSpace(sc.Text()); line != "" {
				select {
				case lines <- line:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return lines
}

// nextLine returns the next line of a feed, or false when it ended; it fails the test, saying
// what it waited for, after waitLimit.
func nextLine(t *testing.T, lines <-chan string, what string) (string, bool) {
	t.Helper()
	select {
	case line, ok := <-lines:
		return line, ok
	case <-time.After(waitLimit):
		t.Fatalf("no %s within %s", what, waitLimit)
		return "", false
	}
}

func TestUpdatesProxyContinuousFeedSeesWrite(t *testing.T) {
	t.Parallel()
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		lines := openFeed(t, p, "/_db_updates?feed=continuous&since=now&heartbeat=200")
		db := couchtest.UniqueName(t, "c")
		p.Server().CreateDB(t, db)
		for {
			line, ok := nextLine(t, lines, "row of "+db)
			require.True(t, ok, "the feed ended before a row of %s", db)
			var row dbUpdate
			require.NoError(t, json.Unmarshal([]byte(line), &row), "line %s", line)
			if row.DBName == db {
				assert.Equal(t, "created", row.Type)
				assert.Regexp(t, seqShape, row.Seq)
				return
			}
		}
	})
}

func TestUpdatesProxyFeedsEndWithLastSeq(t *testing.T) {
	t.Parallel()
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		lines := openFeed(t, p, "/_db_updates?feed=continuous&since=now&timeout=200")
		var end struct {
			LastSeq string `json:"last_seq"`
		}
		for end.LastSeq == "" { // CouchDB may send rows of other tests first
			line, ok := nextLine(t, lines, "last_seq line after the timeout")
			require.True(t, ok, "the feed ended without a last_seq line")
			require.NoError(t, json.Unmarshal([]byte(line), &end), "line %s", line)
		}
		assert.Regexp(t, seqShape, end.LastSeq, "the timeout ends the feed with last_seq")
		_, ok := nextLine(t, lines, "end of the feed after last_seq")
		assert.False(t, ok, "the feed goes on after last_seq")

		start := readUpdates(t, p, "feed=normal&since=now").LastSeq
		db := couchtest.UniqueName(t, "l")
		p.Server().CreateDB(t, db)
		waitRows(t, p, start, hasRows(db, "created"))
		limited := readUpdates(t, p, "feed=normal&limit=1&since="+start)
		require.Len(t, limited.Results, 1)
		assert.Equal(t, limited.Results[0].Seq, limited.LastSeq, "a limited feed ends at its last row")

		if !p.Synthetic() {
			return // CouchDB does not reliably end a continuous feed at its limit
		}
		lines = openFeed(t, p, "/_db_updates?feed=continuous&limit=1&since="+start)
		first, ok := nextLine(t, lines, "row of a limit=1 feed")
		require.True(t, ok)
		var row dbUpdate
		require.NoError(t, json.Unmarshal([]byte(first), &row))
		line, ok := nextLine(t, lines, "last_seq line of a limit=1 feed")
		require.True(t, ok, "limit=1 ends the feed with last_seq")
		require.NoError(t, json.Unmarshal([]byte(line), &end))
		assert.Equal(t, row.Seq, end.LastSeq, "last_seq is the seq of the last row sent")
	})
}

func TestUpdatesProxyCutFailsRequestsAndRestoreRecovers(t *testing.T) {
	t.Parallel()
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		status, _ := get(t, p, "/")
		require.Equal(t, http.StatusOK, status)
		feed := openFeed(t, p, "/_db_updates?feed=continuous&since=now&heartbeat=100")
		changes := p.Server().NewDB(t, "cut")
		changesFeed := openFeed(t, p, "/"+changes+"/_changes?feed=continuous&heartbeat=100")

		p.Cut()
		for _, lines := range []<-chan string{feed, changesFeed} {
			for ok := true; ok; {
				_, ok = nextLine(t, lines, "end of a feed cut by the proxy") // rows sent before may come first
			}
		}
		_, err := p.Server().HTTP.Get(p.URL() + "/")
		assert.Error(t, err, "a cut proxy refuses requests")

		p.Restore(t)
		status, body := get(t, p, "/_db_updates?feed=normal&since=now")
		assert.Equal(t, http.StatusOK, status, "a restored proxy answers again: %s", body)
	})
}
