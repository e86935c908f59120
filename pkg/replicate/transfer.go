package replicate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"sync"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// revsDiff is one doc of a _revs_diff answer.
type revsDiff struct {
	Missing           []string `json:"missing"`
	PossibleAncestors []string `json:"possible_ancestors,omitempty"`
}

// missingRevs asks the target which of revs (id → leaf revs) it lacks; docs lacking nothing
// are absent from the answer.
func missingRevs(ctx context.Context, tgt *endpoint, revs map[string][]string) (map[string]revsDiff, error) {
	out := map[string]revsDiff{}
	if err := tgt.do(ctx, http.MethodPost, tgt.dbPath+"/_revs_diff", nil, revs, &out); err != nil {
		return nil, fmt.Errorf("revs_diff on %s: %w", tgt.shown, err)
	}
	return out, nil
}

// bulkGetResult is one answer of _bulk_get for one requested rev. CouchDB sends {"ok": doc} or
// {"error": {...}}; PouchDB Server {"ok": doc}, {"missing": rev} or {} for a missing doc.
type bulkGetResult struct {
	OK    json.RawMessage `json:"ok"`
	Error *struct {
		Rev    string `json:"rev"`
		Error  string `json:"error"`
		Reason string `json:"reason"`
	} `json:"error"`
	Missing string `json:"missing"`
}

// bulkGetAnswer is the body of a _bulk_get answer.
type bulkGetAnswer struct {
	Results []struct {
		ID   string          `json:"id"`
		Docs []bulkGetResult `json:"docs"`
	} `json:"results"`
}

// fetchedDoc is a revision read from the source, ready for _bulk_docs with new_edits=false:
// its body with _revisions and inline attachments.
type fetchedDoc struct {
	ID, Rev string
	Body    json.RawMessage
}

// skippedRev is a missing rev the source could not return (purged, or gone since _changes).
type skippedRev struct{ ID, Rev, Reason string }

// docs turns the answer into the fetched revs, each (id, rev) once, and the revs it lacks.
func (a bulkGetAnswer) docs() ([]fetchedDoc, []skippedRev) {
	var out []fetchedDoc
	var skipped []skippedRev
	seen := map[[2]string]bool{}
	for _, r := range a.Results {
		for _, d := range r.Docs {
			doc, skip, ok := d.decode(r.ID)
			if !ok {
				skipped = append(skipped, skip)
				continue
			}
			if k := [2]string{doc.ID, doc.Rev}; !seen[k] {
				seen[k] = true
				out = append(out, doc)
			}
		}
	}
	return out, skipped
}

// decode returns the doc of one result, or why there is none.
func (d bulkGetResult) decode(id string) (fetchedDoc, skippedRev, bool) {
	if len(d.OK) == 0 || bytes.Equal(d.OK, []byte("null")) {
		reason := "missing"
		rev := d.Missing
		if d.Error != nil {
			reason, rev = d.Error.Error+": "+d.Error.Reason, d.Error.Rev
		}
		return fetchedDoc{}, skippedRev{ID: id, Rev: rev, Reason: reason}, false
	}
	var meta struct {
		ID  string `json:"_id"`
		Rev string `json:"_rev"`
	}
	if err := json.Unmarshal(d.OK, &meta); err != nil || meta.ID == "" || meta.Rev == "" {
		return fetchedDoc{}, skippedRev{ID: id, Reason: "answer without _id/_rev"}, false
	}
	return fetchedDoc{ID: meta.ID, Rev: meta.Rev, Body: d.OK}, skippedRev{}, true
}

// fetchQuery is the query of both fetch methods: the revision history, the latest leaf
// descending from a requested rev, and attachments inline (base64) with withAttachments, else
// as stubs that carry their length, digest and revpos.
func fetchQuery(withAttachments bool) url.Values {
	return url.Values{"revs": {"true"}, "latest": {"true"}, "attachments": {strconv.FormatBool(withAttachments)}}
}

// bulkGet fetches the missing revs with one _bulk_get (see fetchQuery). unsupported is true when the server
// lacks _bulk_get (CouchDB 1.x: 400, 405 or 501), so the caller falls back to openRevs; a 404
// is a missing db, an error.
func bulkGet(ctx context.Context, src *endpoint, missing map[string]revsDiff, withAttachments bool) (docs []fetchedDoc, skipped []skippedRev, unsupported bool, err error) {
	type ref struct {
		ID  string `json:"id"`
		Rev string `json:"rev"`
	}
	req := struct {
		Docs []ref `json:"docs"`
	}{}
	for id, d := range missing {
		for _, rev := range d.Missing {
			req.Docs = append(req.Docs, ref{id, rev})
		}
	}
	var ans bulkGetAnswer
	err = src.do(ctx, http.MethodPost, src.dbPath+"/_bulk_get", fetchQuery(withAttachments), req, &ans)
	var he *couch.HTTPError
	if errors.As(err, &he) {
		switch he.Status {
		case http.StatusBadRequest, http.StatusMethodNotAllowed, http.StatusNotImplemented:
			return nil, nil, true, nil
		}
	}
	if err != nil {
		return nil, nil, false, fmt.Errorf("bulk_get from %s: %w", src.shown, err)
	}
	docs, skipped = ans.docs()
	return docs, skipped, false, nil
}

// openRevs fetches the missing revs one doc at a time (GET ?open_revs=[...] with Accept JSON,
// the only form PouchDB Server answers), at most workers requests at once.
func openRevs(ctx context.Context, src *endpoint, missing map[string]revsDiff, withAttachments bool, workers int) ([]fetchedDoc, []skippedRev, error) {
	var (
		mu      sync.Mutex
		docs    []fetchedDoc
		skipped []skippedRev
		errs    []error
		wg      sync.WaitGroup
		sem     = make(chan struct{}, max(workers, 1))
	)
	for id, d := range missing {
		revs, err := json.Marshal(d.Missing)
		if err != nil {
			return nil, nil, err
		}
		q := fetchQuery(withAttachments)
		q.Set("open_revs", string(revs))
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			var ans openRevsAnswer
			err := src.do(ctx, http.MethodGet, src.docPath(id), q, nil, &ans)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("open_revs of %q from %s: %w", id, src.shown, err))
				return
			}
			a := bulkGetAnswer{Results: []struct {
				ID   string          `json:"id"`
				Docs []bulkGetResult `json:"docs"`
			}{{ID: id, Docs: ans}}}
			got, skip := a.docs()
			docs, skipped = append(docs, got...), append(skipped, skip...)
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		return nil, nil, errors.Join(errs...)
	}
	return docs, skipped, nil
}

// writeFailure is a doc the target refused (validate_doc_update, permissions, size).
type writeFailure struct{ ID, Rev, Error, Reason string }

// bulkDocs writes docs to the target with new_edits=false and returns the docs it refused.
// A 413 (request too large) splits the batch in halves. Other request failures are errors.
func bulkDocs(ctx context.Context, tgt *endpoint, docs []fetchedDoc) ([]writeFailure, error) {
	if len(docs) == 0 {
		return nil, nil
	}
	var body bytes.Buffer
	body.WriteString(`{"new_edits":false,"docs":[`)
	for i, d := range docs {
		if i > 0 {
			body.WriteByte(',')
		}
		body.Write(d.Body)
	}
	body.WriteString("]}")
	var ans []struct {
		ID     string `json:"id"`
		Rev    string `json:"rev"`
		Error  string `json:"error"`
		Reason string `json:"reason"`
	}
	err := tgt.do(ctx, http.MethodPost, tgt.dbPath+"/_bulk_docs", nil, body.Bytes(), &ans)
	var he *couch.HTTPError
	if errors.As(err, &he) && he.Status == http.StatusRequestEntityTooLarge && len(docs) > 1 {
		a, err := bulkDocs(ctx, tgt, docs[:len(docs)/2])
		if err != nil {
			return nil, err
		}
		b, err := bulkDocs(ctx, tgt, docs[len(docs)/2:])
		return append(a, b...), err
	}
	if err != nil {
		return nil, fmt.Errorf("bulk_docs to %s: %w", tgt.shown, err)
	}
	var failed []writeFailure
	for _, a := range ans {
		if a.Error == "" {
			continue
		}
		if a.Rev == "" { // PouchDB Server's errors name the doc only
			a.Rev = revOf(docs, a.ID)
		}
		failed = append(failed, writeFailure{a.ID, a.Rev, a.Error, a.Reason})
	}
	return failed, nil
}

// revOf returns the rev of id among docs when there is exactly one, else "".
func revOf(docs []fetchedDoc, id string) string {
	rev := ""
	for _, d := range docs {
		if d.ID == id {
			if rev != "" {
				return ""
			}
			rev = d.Rev
		}
	}
	return rev
}
