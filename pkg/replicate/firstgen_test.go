package replicate

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// row is a change row of one leaf with the doc read with it.
func row(id, rev, doc string) change {
	c := change{ID: id, Doc: json.RawMessage(doc)}
	c.Changes = append(c.Changes, struct {
		Rev string `json:"rev"`
	}{rev})
	return c
}

func TestFirstGenerationTakesOnlyWholeRows(t *testing.T) {
	d, ok := firstGeneration(row("a", "1-abc", ` {"_id":"a","_rev":"1-abc","x":"<&>","n":[1,2]} `))
	require.True(t, ok)
	assert.Equal(t, "a", d.ID)
	assert.Equal(t, "1-abc", d.Rev)
	var body map[string]any
	require.NoError(t, json.Unmarshal(d.Body, &body))
	assert.Equal(t, map[string]any{"_id": "a", "_rev": "1-abc", "x": "<&>", "n": []any{1.0, 2.0},
		"_revisions": map[string]any{"start": 1.0, "ids": []any{"abc"}}}, body)
	assert.True(t, strings.HasPrefix(string(d.Body), `{"_id":"a","_rev":"1-abc","x":"<&>"`), "the doc as read, not re-encoded: %s", d.Body)

	del, ok := firstGeneration(row("b", "1-def", `{"_id":"b","_rev":"1-def","_deleted":true}`))
	require.True(t, ok, "a doc created deleted")
	assert.Contains(t, string(del.Body), `"_deleted":true`)

	two := row("a", "1-abc", `{"_id":"a","_rev":"1-abc"}`)
	two.Changes = append(two.Changes, two.Changes[0])
	two.Changes[1].Rev = "1-zzz"
	for name, c := range map[string]change{
		"second generation":         row("a", "2-abc", `{"_id":"a","_rev":"2-abc"}`),
		"edited after the row":      row("a", "1-abc", `{"_id":"a","_rev":"2-xyz"}`),
		"another doc":               row("a", "1-abc", `{"_id":"b","_rev":"1-abc"}`),
		"attachments (stubs only)":  row("a", "1-abc", `{"_id":"a","_rev":"1-abc","_attachments":{"f":{"stub":true}}}`),
		"conflicts":                 row("a", "1-abc", `{"_id":"a","_rev":"1-abc","_conflicts":["1-zzz"]}`),
		"two leaves":                two,
		"no doc (include_docs off)": row("a", "1-abc", ``),
		"not an object":             row("a", "1-abc", `["_id"]`),
		"no hash":                   row("a", "1-", `{"_id":"a","_rev":"1-"}`),
	} {
		_, ok := firstGeneration(c)
		assert.False(t, ok, name)
	}
}

func FuzzFirstGeneration(f *testing.F) {
	f.Add("a", "1-abc", `{"_id":"a","_rev":"1-abc","x":1}`)
	f.Add("a", "1-abc", `{"_id":"a","_rev":"1-abc","_deleted":true}`)
	f.Add("a\"b", "1-x", `{"_id":"a\"b","_rev":"1-x","_revisions":{}}`)
	f.Add("a", "2-abc", `{"_id":"a","_rev":"2-abc"}`)
	f.Fuzz(func(t *testing.T, id, rev, doc string) {
		d, ok := firstGeneration(row(id, rev, doc))
		if !ok {
			return
		}
		var body struct {
			ID        string `json:"_id"`
			Rev       string `json:"_rev"`
			Revisions struct {
				Start int      `json:"start"`
				IDs   []string `json:"ids"`
			} `json:"_revisions"`
		}
		require.NoError(t, json.Unmarshal(d.Body, &body), "body %q", d.Body)
		require.True(t, json.Valid(d.Body))
		assert.Equal(t, id, body.ID)
		assert.Equal(t, rev, body.Rev)
		assert.Equal(t, 1, body.Revisions.Start)
		assert.Equal(t, []string{strings.TrimPrefix(rev, "1-")}, body.Revisions.IDs)
	})
}

// New docs replicate with _changes, _revs_diff and _bulk_docs: the page carries them, no
// _bulk_get. A target that holds them already is sent nothing. An edit is fetched with _bulk_get,
// and a db whose docs are edited reads its pages without the docs after the first.
func TestFirstGenerationSkipsBulkGet(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "fgsrc_"), s.NewDB(t, "fgtgt_")
	log := &requestLog{base: &http.Transport{DisableCompression: true}, queries: true}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), HTTPClient: &http.Client{Transport: log}, BatchSize: 5}
	createDocs(t, s, source, "new", 12)
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 12, res.DocsWritten)
	assert.EqualValues(t, 12, res.DocsRead)
	reqs := log.take()
	assert.Equal(t, 3, count(reqs, toEndpoint("_revs_diff")), "one per batch of 5: %v", reqs)
	assert.Zero(t, count(reqs, toEndpoint("_bulk_get")), "%v", reqs)
	assert.Equal(t, 3, count(reqs, toEndpoint("_bulk_docs")), "%v", reqs)
	requireSameLeaves(t, s, source, target)

	again := opt // another replication (its doc ids): no checkpoint, from the beginning
	for i := range 12 {
		again.DocIDs = append(again.DocIDs, fmt.Sprintf("new%06d", i))
	}
	res, err = Run(t.Context(), again, testLog(t))
	require.NoError(t, err)
	assert.Zero(t, res.DocsWritten, "the target holds them")
	reqs = log.take()
	assert.Zero(t, count(reqs, toEndpoint("_bulk_docs")), "%v", reqs)

	for i := range 12 {
		id := fmt.Sprintf("new%06d", i)
		var doc map[string]any
		require.NoError(t, s.Do(t, "GET", "/"+couchtest.PathDB(source)+"/"+id, nil, &doc))
		doc["edited"] = true
		s.Put(t, source, id, doc)
	}
	res, err = Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 12, res.DocsWritten)
	reqs = log.take()
	assert.Equal(t, 3, count(reqs, toEndpoint("_bulk_get")), "edits: %v", reqs)
	assert.Equal(t, 1, count(reqs, func(r string) bool {
		return strings.Contains(r, "/_changes") && strings.Contains(r, "include_docs=true")
	}),
		"only the first page read the docs: %v", reqs)
	requireSameLeaves(t, s, source, target)

	off := opt
	off.noFirstGeneration = true
	createDocs(t, s, source, "off", 3)
	_, err = Run(t.Context(), off, testLog(t))
	require.NoError(t, err)
	reqs = log.take()
	assert.Equal(t, 1, count(reqs, toEndpoint("_bulk_get")), "the shortcut off: %v", reqs)
	assert.Zero(t, count(reqs, func(r string) bool { return strings.Contains(r, "include_docs") }), "%v", reqs)
	requireSameLeaves(t, s, source, target)
}

// toEndpoint matches the logged requests to a db endpoint.
func toEndpoint(name string) func(string) bool {
	return func(r string) bool { return strings.Contains(strings.SplitN(r, "?", 2)[0], "/"+name) }
}
