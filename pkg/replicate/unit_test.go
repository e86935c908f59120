package replicate

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// fixture returns the response content type and body of the exchange name recorded in the
// fixture set set (couchtest.FixtureSets).
func fixture(t *testing.T, set, name string) (contentType string, body []byte) {
	t.Helper()
	rec := couchtest.FixtureFrom(t, set, name)
	return rec.ContentType, rec.Body
}

// forEachSet runs fn as a subtest per fixture set: CouchDB 3.3.3, 3.5.2, a 3.5.2 cluster.
func forEachSet(t *testing.T, fn func(t *testing.T, set string)) {
	t.Helper()
	for _, set := range couchtest.FixtureSets() {
		t.Run(set, func(t *testing.T) { fn(t, set) })
	}
}

func TestFixtureRevsDiff(t *testing.T) {
	forEachSet(t, func(t *testing.T, set string) {
		_, body := fixture(t, set, "revs-diff")
		var got map[string]revsDiff
		require.NoError(t, json.Unmarshal(body, &got))
		assert.Equal(t, map[string]revsDiff{
			"doc2":   {Missing: []string{"1-abc", "9-zzz"}, PossibleAncestors: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			"nosuch": {Missing: []string{"1-x"}},
		}, got)
	})
}

func TestFixtureBulkGet(t *testing.T) {
	forEachSet(t, func(t *testing.T, set string) {
		_, body := fixture(t, set, "bulk-get")
		var ans bulkGetAnswer
		require.NoError(t, json.Unmarshal(body, &ans))
		docs, skipped := ans.docs()
		require.Len(t, docs, 1)
		assert.Equal(t, "doc2", docs[0].ID)
		assert.Equal(t, "1-614d864b534ab8997c7b06ce8a683752", docs[0].Rev)
		assert.Contains(t, string(docs[0].Body), `"_revisions"`)
		require.Len(t, skipped, 1)
		assert.Equal(t, "nosuch", skipped[0].ID)
		assert.Contains(t, skipped[0].Reason, "not_found")
	})
}

func TestBulkGetPouchDBShapes(t *testing.T) {
	t.Parallel()
	body := `{"results":[{"id":"a","docs":[{}]},{"id":"b","docs":[{"missing":"1-x"}]},` +
		`{"id":"c","docs":[{"ok":{"_id":"c","_rev":"2-y","_revisions":{"start":2,"ids":["y","x"]}}},{"ok":{"_id":"c","_rev":"2-y"}}]}]}`
	var ans bulkGetAnswer
	require.NoError(t, json.Unmarshal([]byte(body), &ans))
	docs, skipped := ans.docs()
	require.Len(t, docs, 1, "a rev returned twice (latest=true) is written once")
	assert.Equal(t, "2-y", docs[0].Rev)
	assert.Equal(t, []skippedRev{{ID: "a", Reason: "missing"}, {ID: "b", Rev: "1-x", Reason: "missing"}}, skipped)
}

func TestFixtureOpenRevsMultipart(t *testing.T) {
	forEachSet(t, func(t *testing.T, set string) {
		ct, body := fixture(t, set, "open-revs-all")
		var ans openRevsAnswer
		require.NoError(t, ans.DecodeResponse(ct, bytes.NewReader(body)))
		a := bulkGetAnswer{Results: []struct {
			ID   string          `json:"id"`
			Docs []bulkGetResult `json:"docs"`
		}{{ID: "doc2", Docs: ans}}}
		docs, skipped := a.docs()
		assert.Empty(t, skipped)
		require.Len(t, docs, 1)
		assert.Equal(t, "2-0123456789abcdef0123456789abcdef", docs[0].Rev)

		var js openRevsAnswer
		require.NoError(t, js.DecodeResponse("application/json", strings.NewReader(`[{"ok":{"_id":"d","_rev":"1-a"}},{"missing":"1-b"}]`)))
		assert.Len(t, js, 2)
		assert.Equal(t, "1-b", js[1].Missing)
	})
}

func TestFixtureCheckpointDocs(t *testing.T) {
	forEachSet(t, func(t *testing.T, set string) {
		_, body := fixture(t, set, "get-local")
		var doc checkpointDoc
		require.NoError(t, json.Unmarshal(body, &doc))
		assert.Equal(t, "s1", doc.SessionID)
		assert.Equal(t, couch.Seq("1-abc"), doc.SourceLastSeq)
		assert.Equal(t, "0-1", doc.Rev)

		_, body = fixture(t, set, "put-local")
		var ans struct {
			Rev string `json:"rev"`
		}
		require.NoError(t, json.Unmarshal(body, &ans))
		assert.Equal(t, "0-1", ans.Rev)

		// PouchDB Server's integer seqs read back as their text.
		require.NoError(t, json.Unmarshal([]byte(`{"session_id":"s","source_last_seq":42,"history":[{"session_id":"s","recorded_seq":42}]}`), &doc))
		assert.Equal(t, couch.Seq("42"), doc.SourceLastSeq)
		assert.Equal(t, couch.Seq("42"), doc.History[0].RecordedSeq)
	})
}

func TestFixtureChanges(t *testing.T) {
	forEachSet(t, func(t *testing.T, set string) {
		_, body := fixture(t, set, "changes-with-deletion")
		var p changesPage
		require.NoError(t, json.Unmarshal(body, &p))
		require.Len(t, p.Results, 4)
		assert.True(t, p.Results[3].Deleted)
		assert.Equal(t, "doc1", p.Results[3].ID)
		assert.Equal(t, "2-e756583c203257552e07a1bfc6aa9047", p.Results[3].Changes[0].Rev)
		assert.True(t, strings.HasPrefix(string(p.LastSeq), "5-g1AAAA"))

		_, body = fixture(t, set, "bulk-docs-new-edits-false")
		var ans []map[string]any
		require.NoError(t, json.Unmarshal(body, &ans))
		assert.Empty(t, ans, "CouchDB 3 answers [] when every new_edits=false doc is stored")
	})
}

func TestFindStartSeq(t *testing.T) {
	t.Parallel()
	h := func(ids ...string) []historyEntry {
		var out []historyEntry
		for _, id := range ids {
			out = append(out, historyEntry{SessionID: id, RecordedSeq: couch.Seq("seq-" + id)})
		}
		return out
	}
	cases := []struct {
		name     string
		src, tgt *checkpointDoc
		seq      couch.Seq
		history  []historyEntry
	}{
		{"no checkpoints", nil, nil, "", nil},
		{"source only", &checkpointDoc{SessionID: "a", SourceLastSeq: "9"}, nil, "", nil},
		{"same session", &checkpointDoc{SessionID: "c", SourceLastSeq: "9", History: h("c", "b")},
			&checkpointDoc{SessionID: "c", SourceLastSeq: "9", History: h("c", "b")}, "9", h("c", "b")},
		{"target behind", &checkpointDoc{SessionID: "c", History: h("c", "b", "a")},
			&checkpointDoc{SessionID: "b", History: h("b", "a")}, "seq-b", h("a")},
		{"source behind", &checkpointDoc{SessionID: "b", History: h("b", "a")},
			&checkpointDoc{SessionID: "d", History: h("d", "c", "b", "a")}, "seq-b", h("a")},
		{"diverged", &checkpointDoc{SessionID: "x", History: h("x", "a")},
			&checkpointDoc{SessionID: "y", History: h("y", "a")}, "seq-a", nil},
		{"nothing in common", &checkpointDoc{SessionID: "x", History: h("x")},
			&checkpointDoc{SessionID: "y", History: h("y")}, "", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			seq, hist := findStartSeq(c.src, c.tgt)
			assert.Equal(t, c.seq, seq)
			if len(c.history) == 0 {
				assert.Empty(t, hist)
			} else {
				assert.Equal(t, c.history, hist)
			}
		})
	}
}

func TestReplicationID(t *testing.T) {
	t.Parallel()
	base := Options{Source: "http://admin:pw@Host:5984/src", Target: "https://u:p@other/db%2Fx/"}
	id := ReplicationID(base, "")
	assert.Len(t, id, 32)

	same := base
	same.Source, same.Target = "http://other:secret@host:5984/src/", "https://other/db%2Fx"
	same.BatchSize, same.Workers, same.CreateTarget = 7, 9, true
	assert.Equal(t, id, ReplicationID(same, ""), "credentials and tuning do not matter")

	for name, o := range map[string]Options{
		"source":   {Source: "http://host:5984/src2", Target: base.Target},
		"target":   {Source: base.Source, Target: "https://other/db"},
		"filter":   {Source: base.Source, Target: base.Target, Filter: "d/f"},
		"params":   {Source: base.Source, Target: base.Target, Filter: "d/f", QueryParams: map[string]any{"k": 1}},
		"doc_ids":  {Source: base.Source, Target: base.Target, DocIDs: []string{"a"}},
		"selector": {Source: base.Source, Target: base.Target, Selector: map[string]any{"a": 1}},
	} {
		assert.NotEqual(t, id, ReplicationID(o, ""), name)
	}
	// The same selector written in another key order (another rule doc revision, another
	// process) is the same replication; another selector is not.
	var sel1, sel2, other map[string]any
	require.NoError(t, json.Unmarshal([]byte(`{"a":1,"b":{"$gt":2,"$lt":9}}`), &sel1))
	require.NoError(t, json.Unmarshal([]byte(`{"b":{"$lt":9,"$gt":2},"a":1}`), &sel2))
	require.NoError(t, json.Unmarshal([]byte(`{"a":1,"b":{"$gt":3,"$lt":9}}`), &other))
	withSel := func(s map[string]any) string {
		return ReplicationID(Options{Source: "http://h/a", Target: "http://h/b", Selector: s}, "")
	}
	assert.Equal(t, withSel(sel1), withSel(sel2), "key order does not matter")
	assert.NotEqual(t, withSel(sel1), withSel(other))

	// A design-doc filter: its code is part of the id, so an edited filter is a new replication.
	filtered := Options{Source: "http://h/a", Target: "http://h/b", Filter: "d/f"}
	v1 := ReplicationID(filtered, "function(doc) { return doc.type === 'a' }")
	assert.NotEqual(t, v1, ReplicationID(filtered, "function(doc) { return doc.type === 'b' }"))
	assert.Equal(t, v1, ReplicationID(filtered, "function(doc) { return doc.type === 'a' }"))

	assert.Equal(t, "9c4b440e07a14e2b2187fbe2e1852be6", ReplicationID(Options{Source: "http://h/a", Target: "http://h/b"}, ""), "stable across releases: changing it orphans every checkpoint")
}

func TestNewEndpoint(t *testing.T) {
	t.Parallel()
	e, err := newEndpoint("http://u:pw@Example.com:5984/prefix/my%2Fdb%2Bx/", http.DefaultTransport, http.DefaultTransport)
	require.NoError(t, err)
	assert.Equal(t, "my/db+x", e.db)
	assert.Equal(t, "/my%2Fdb%2Bx", e.dbPath)
	assert.Equal(t, "http://u:pw@example.com:5984/prefix", e.c.BaseURL().String(), "the server: credentials, lower-cased host, path prefix")
	assert.NotContains(t, e.shown, "pw")
	assert.Equal(t, "/my%2Fdb%2Bx/_design/a%20b", e.docPath("_design/a b"))

	for _, bad := range []string{"", "ftp://h/db", "http://h", "http://h/", "http://u:pw@h/db?x=1"} {
		_, err := newEndpoint(bad, http.DefaultTransport, http.DefaultTransport)
		if assert.Error(t, err, bad) {
			assert.NotContains(t, err.Error(), "pw")
		}
	}
}
