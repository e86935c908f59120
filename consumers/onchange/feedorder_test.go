package main

import (
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// A sharded CouchDB's _changes is not in write order (each shard keeps its own order), and
// a feed read in pages may list the rows of different shards in another order than one read in
// one go. Tests therefore never expect the order of writes: they check feed order with seqOrder
// and progress with changesSince.

// seqOrder is a test-only oracle for the position of a seq in its db's feed: the number before
// the first '-' of a CouchDB 2+/3 seq (the sum of the shard positions it covers, which grows
// with every row of a feed on a single node) or PouchDB Server's integer seq. The product never
// parses seqs; tests use this to check that things happened in feed order.
func seqOrder(t testing.TB, seq string) int64 {
	t.Helper()
	head, _, _ := strings.Cut(seq, "-")
	n, err := strconv.ParseInt(head, 10, 64)
	require.NoError(t, err, "seq %q has no leading number", seq)
	return n
}

// requireFeedOrder fails unless seqs never go back (a change retried keeps its seq).
func requireFeedOrder(t testing.TB, seqs []string, msg string) {
	t.Helper()
	for i := 1; i < len(seqs); i++ {
		require.LessOrEqual(t, seqOrder(t, seqs[i-1]), seqOrder(t, seqs[i]), "%s: %v", msg, seqs)
	}
}

// changesSince returns the doc ids of db's changes after since ("" = from the beginning).
func (e *env) changesSince(t testing.TB, db, since string) []string {
	t.Helper()
	path := "/" + couchtest.PathDB(db) + "/_changes"
	if since != "" {
		path += "?since=" + url.QueryEscape(since)
	}
	var body struct {
		Results []struct {
			ID string `json:"id"`
		} `json:"results"`
	}
	require.NoError(t, e.Couch.Do(t, "GET", path, nil, &body))
	out := make([]string, 0, len(body.Results))
	for _, r := range body.Results {
		out = append(out, r.ID)
	}
	return out
}

// caughtUp reports whether rule's checkpoint in db exists and has no change after it.
func (e *env) caughtUp(t testing.TB, rule, db string) bool {
	t.Helper()
	cp, ok := e.checkpoint(t, rule, db)
	return ok && cp != "" && len(e.changesSince(t, db, cp)) == 0
}

// seqParams returns the "seq" param of each hit, in order.
func seqParams(hs []hit) []string {
	out := make([]string, 0, len(hs))
	for _, h := range hs {
		out = append(out, h.param("seq"))
	}
	return out
}

// count returns how often each id occurs.
func count(ids []string) map[string]int {
	out := map[string]int{}
	for _, id := range ids {
		out[id]++
	}
	return out
}
