package replicate

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"

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
	Doc json.RawMessage `json:"doc,omitempty"` // only when filtering locally
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
}

// newChangesReader prepares the reader for opt. pouchDB tells whether the source server is
// PouchDB Server; it matters only with a selector.
func newChangesReader(src *endpoint, opt Options, pouchDB bool) (*changesReader, error) {
	r := &changesReader{src: src, limit: opt.BatchSize, query: url.Values{}}
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
	if since != "" {
		q.Set("since", string(since))
	}
	if r.filter != "" {
		q.Set("filter", r.filter)
	}
	if r.local != nil {
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
	for _, c := range p.Results {
		if c.ID == "" || len(c.Changes) == 0 {
			continue
		}
		if r.local != nil {
			if !r.local.MatchRaw(c.Doc) {
				continue
			}
			c.Doc = nil
		}
		kept = append(kept, c)
	}
	p.Results = kept
	return p, raw, nil
}
