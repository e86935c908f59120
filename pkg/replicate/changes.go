package replicate

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/mango"
)

// change is one row of the source's _changes (style=all_docs): every leaf rev of the doc.
type change struct {
	Seq     couch.Seq `json:"seq"`
	ID      string    `json:"id"`
	Deleted bool      `json:"deleted,omitempty"`
	Changes []struct {
		Rev string `json:"rev"`
	} `json:"changes"`
	// Doc is the doc at its winning rev, when the page was read with include_docs (see
	// changesReader.docs, firstGeneration).
	Doc json.RawMessage `json:"doc,omitempty"`
}

// changesPage is one answer of a normal _changes feed.
type changesPage struct {
	Results []change  `json:"results"`
	LastSeq couch.Seq `json:"last_seq"`
}

// changesReader reads the source's _changes in pages, with the run's filter applied by the
// server, or locally for a selector on PouchDB Server (whose _selector filter crashes it).
type changesReader struct {
	src    *endpoint
	limit  int
	filter string     // server-side filter name ("" none)
	query  url.Values // filter parameters
	body   any        // POST body (doc_ids, selector), nil for GET
	local  *mango.Selector
	// docs asks the next page with include_docs, for the first-generation revisions the batch
	// writes without fetching them (see firstGeneration). On at first; each page
	// turns it off when fewer than half its rows were such revisions (a db whose docs are
	// updated, not created: their bodies would be read for nothing), and on again otherwise.
	docs    bool
	noFirst bool // the shortcut is off: docs stays off
}

// newChangesReader prepares the reader for opt. pouchDB tells whether the source server is
// PouchDB Server; it matters only with a selector.
func newChangesReader(src *endpoint, opt Options, pouchDB bool) (*changesReader, error) {
	r := &changesReader{src: src, limit: opt.BatchSize, query: url.Values{}, docs: !opt.noFirstGeneration, noFirst: opt.noFirstGeneration}
	switch {
	case len(opt.DocIDs) > 0:
		r.filter = "_doc_ids"
		r.body = map[string]any{"doc_ids": opt.DocIDs}
	case opt.Selector != nil:
		if !pouchDB {
			r.filter = "_selector"
			r.body = map[string]any{"selector": opt.Selector}
			break
		}
		sel, err := mango.Compile(opt.Selector)
		if err != nil {
			return nil, fmt.Errorf("compile selector: %w", err)
		}
		r.local = sel
	case opt.Filter != "":
		r.filter = opt.Filter
		for k, v := range opt.QueryParams {
			r.query.Set(k, queryParam(v))
		}
	}
	return r, nil
}

// queryParam renders a filter parameter: strings as they are, anything else as JSON.
func queryParam(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(data)
}

// page reads at most limit rows after since ("" = the beginning). Rows without an id are
// dropped (some CouchDB versions sent them); with a local selector, rows whose winning doc
// does not match are dropped too (a deleted doc matches only a selector a `{}` body satisfies).
// raw is the row count before dropping, for the caller's end-of-feed test (raw < limit).
// A 404 is returned as is (errors.Is(err, couch.ErrNotFound)): the db or the filter is missing.
func (r *changesReader) page(ctx context.Context, since couch.Seq) (p changesPage, raw int, err error) {
	q := url.Values{}
	for k, vs := range r.query {
		q[k] = vs
	}
	q.Set("feed", "normal")
	q.Set("style", "all_docs")
	q.Set("limit", strconv.Itoa(r.limit))
	// A run checkpoints at a page's last_seq only and never reads a row's seq, so CouchDB 2.1+
	// need not pack one for each row (a quarter of its CPU per row on a long page with docs):
	// with seq_interval equal to the limit it packs one for a page's first row, null for the
	// others, and last_seq as always. CouchDB's own replicator asks the same; servers without
	// the parameter (PouchDB Server, CouchDB before 2.1) ignore it.
	q.Set("seq_interval", strconv.Itoa(r.limit))
	if since != "" {
		q.Set("since", string(since))
	}
	if r.filter != "" {
		q.Set("filter", r.filter)
	}
	if r.local != nil || r.docs {
		q.Set("include_docs", "true")
	}
	method := http.MethodGet
	if r.body != nil {
		method = http.MethodPost
	}
	if err := r.src.do(ctx, method, r.src.dbPath+"/_changes", q, r.body, &p); err != nil {
		return changesPage{}, 0, err
	}
	raw = len(p.Results)
	kept := p.Results[:0]
	first := 0 // rows of one first-generation revision
	for _, c := range p.Results {
		if c.ID == "" || len(c.Changes) == 0 {
			continue
		}
		if r.local != nil && !r.local.MatchRaw(c.Doc) {
			continue
		}
		if len(c.Changes) == 1 && strings.HasPrefix(c.Changes[0].Rev, "1-") {
			first++
		}
		if !r.docs {
			c.Doc = nil // read for the local selector only
		}
		kept = append(kept, c)
	}
	p.Results = kept
	if len(kept) > 0 && r.docs != (first*2 >= len(kept)) && !r.noFirst {
		r.docs = !r.docs
	}
	return p, raw, nil
}

// firstGeneration returns the revision of a change row ready for _bulk_docs with
// new_edits=false when the row carries all the write needs, so that the batch does not ask the
// source's _bulk_get for it when the target lacks it: the doc has one leaf, of generation 1 (a
// doc created and not edited since: its history is that revision alone), the page was read with
// include_docs and gave the doc at that very revision (not one edited after the row was read),
// and the doc has no attachments (include_docs gives their stubs only). The body is the doc as
// read with its _revisions added. A new doc is what most writes to a user db are; PouchDB's
// replicator reads first-generation docs the same way, without their history.
func firstGeneration(c change) (fetchedDoc, bool) {
	if len(c.Changes) != 1 || len(c.Doc) == 0 {
		return fetchedDoc{}, false
	}
	rev := c.Changes[0].Rev
	hash, ok := strings.CutPrefix(rev, "1-")
	if !ok || hash == "" {
		return fetchedDoc{}, false
	}
	var meta struct {
		ID          string          `json:"_id"`
		Rev         string          `json:"_rev"`
		Attachments json.RawMessage `json:"_attachments"`
		Conflicts   json.RawMessage `json:"_conflicts"`
		Revisions   json.RawMessage `json:"_revisions"`
	}
	if json.Unmarshal(c.Doc, &meta) != nil || meta.ID != c.ID || meta.Rev != rev ||
		meta.Attachments != nil || meta.Conflicts != nil || meta.Revisions != nil {
		return fetchedDoc{}, false
	}
	doc := bytes.TrimSpace(c.Doc)
	if len(doc) < 2 || doc[0] != '{' || doc[len(doc)-1] != '}' {
		return fetchedDoc{}, false
	}
	revisions, err := json.Marshal(map[string]any{"start": 1, "ids": []string{hash}})
	if err != nil {
		return fetchedDoc{}, false
	}
	body := make([]byte, 0, len(doc)+len(revisions)+16)
	body = append(body, doc[:len(doc)-1]...)
	body = append(body, `,"_revisions":`...)
	body = append(body, revisions...)
	body = append(body, '}')
	return fetchedDoc{ID: c.ID, Rev: rev, Body: body}, true
}
