package replicate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// inlineAttachmentLimit is the most attachment bytes (stub lengths) a revision may need sent
// for it to travel inline (base64, in a _bulk_get answer and a _bulk_docs body); a revision
// needing more is streamed as multipart/related.
const inlineAttachmentLimit = 256 << 10

// inlineBatchLimit bounds the attachment bytes of one inline _bulk_get: the inline docs of a
// batch are fetched and written in groups of at most this much (a single larger doc alone).
const inlineBatchLimit = 8 << 20

// attachmentStub is an entry of a doc's _attachments as fetched without attachment bodies.
type attachmentStub struct {
	ContentType string `json:"content_type"`
	Length      int64  `json:"length"`
	RevPos      int    `json:"revpos"`
	Stub        bool   `json:"stub"`
}

// attachedDoc is a fetched revision whose attachments are stubs: its body still lacks them.
type attachedDoc struct {
	doc       fetchedDoc
	revisions struct {
		Start int      `json:"start"`
		IDs   []string `json:"ids"`
	}
	atts map[string]attachmentStub
}

// splitAttachments separates the revisions that _bulk_docs can take as they are (no
// attachments, or attachments inline) from those with attachment stubs.
func splitAttachments(docs []fetchedDoc) (plain []fetchedDoc, withAtts []attachedDoc) {
	for _, d := range docs {
		if !bytes.Contains(d.Body, []byte(`"_attachments"`)) {
			plain = append(plain, d)
			continue
		}
		var v struct {
			Revisions   json.RawMessage           `json:"_revisions"`
			Attachments map[string]attachmentStub `json:"_attachments"`
		}
		a := attachedDoc{doc: d}
		if json.Unmarshal(d.Body, &v) != nil || len(v.Attachments) == 0 {
			plain = append(plain, d)
			continue
		}
		stubs := false
		for _, s := range v.Attachments {
			stubs = stubs || s.Stub
		}
		if !stubs {
			plain = append(plain, d)
			continue
		}
		_ = json.Unmarshal(v.Revisions, &a.revisions)
		a.atts = v.Attachments
		withAtts = append(withAtts, a)
	}
	return plain, withAtts
}

// ancestorPos returns the highest generation among revs ("N-hash") that lies on the doc's
// revision path, 0 if none does. The target holding such a rev holds every attachment of the
// doc whose revpos is at most that generation (CouchDB's atts_since rule).
func (a attachedDoc) ancestorPos(revs []string) int {
	best := 0
	for _, rev := range revs {
		n, hash, ok := strings.Cut(rev, "-")
		pos, err := strconv.Atoi(n)
		if !ok || err != nil {
			continue
		}
		i := a.revisions.Start - pos
		if pos > best && i >= 0 && i < len(a.revisions.IDs) && a.revisions.IDs[i] == hash {
			best = pos
		}
	}
	return best
}

// needed returns, sorted, the attachments the target lacks when it holds the ancestor of
// generation pos (0: none), and the sum of their lengths.
func (a attachedDoc) needed(pos int) ([]string, int64) {
	var names []string
	var size int64
	for name, s := range a.atts {
		if s.Stub && (pos == 0 || s.RevPos > pos || s.RevPos <= 0) {
			names = append(names, name)
			size += s.Length
		}
	}
	sort.Strings(names) // the order of encoding/json's map keys: the order of the parts
	return names, size
}

// streamable reports whether the names can be sent as multipart parts: PouchDB Server matches
// a part to its attachment by the part's filename, so only plain names are trusted to it.
func streamable(names []string) bool {
	for _, n := range names {
		if n == "" || strings.ContainsAny(n, "\"\\\r\n") {
			return false
		}
		for _, c := range n {
			if c < 0x20 || c > 0x7e {
				return false
			}
		}
	}
	return true
}

// transferAttachments writes revisions fetched with attachment stubs. Attachments the target
// already holds (in a possible ancestor from _revs_diff, or, for a large revision on a target
// that names none, in one of its leaves) stay stubs. A revision needing nothing more is written
// with _bulk_docs as it is; one needing at most inlineAttachmentLimit bytes is fetched again
// with its attachments inline, in batched _bulk_gets, and written with _bulk_docs; a larger one
// is streamed, one revision at a time, from GETs of its attachments to a multipart/related PUT
// with new_edits=false. It returns the number of revisions written, those refused and those
// the source no longer had; errors are request failures.
func (r *run) transferAttachments(ctx context.Context, docs []attachedDoc, missing map[string]revsDiff) (int, []writeFailure, []skippedRev, error) {
	var stubbed, inline []attachedDoc
	type streamDoc struct {
		attachedDoc
		names []string
	}
	var streamed []streamDoc
	for _, d := range docs {
		ancestors := missing[d.doc.ID].PossibleAncestors
		names, size := d.needed(d.ancestorPos(ancestors))
		if size > inlineAttachmentLimit && len(ancestors) == 0 {
			leaves, err := targetLeaves(ctx, r.tgt, d.doc.ID)
			if err != nil {
				return 0, nil, nil, err
			}
			names, size = d.needed(d.ancestorPos(leaves))
		}
		switch {
		case len(names) == 0:
			stubbed = append(stubbed, d)
		case size <= inlineAttachmentLimit || !streamable(names):
			inline = append(inline, d)
		default:
			streamed = append(streamed, streamDoc{d, names})
		}
	}
	written := 0
	var failed []writeFailure
	var skipped []skippedRev
	if len(stubbed) > 0 {
		plain := make([]fetchedDoc, len(stubbed))
		for i, d := range stubbed {
			plain[i] = d.doc
		}
		f, err := bulkDocs(ctx, r.tgt, plain)
		var he *couch.HTTPError
		switch {
		case errors.As(err, &he) && he.Status == http.StatusPreconditionFailed: // missing_stub
			inline = append(inline, stubbed...)
		case err != nil:
			return 0, nil, nil, err
		default:
			written, failed = written+len(plain)-len(f), append(failed, f...)
		}
	}
	for _, d := range streamed {
		f, ok, err := r.putMultipart(ctx, d.attachedDoc, d.names)
		switch {
		case err != nil:
			return 0, nil, nil, err
		case !ok:
			inline = append(inline, d.attachedDoc)
		case f != nil:
			failed = append(failed, *f)
		default:
			written++
		}
	}
	for start := 0; start < len(inline); {
		group := map[string]revsDiff{}
		var size int64
		end := start
		for ; end < len(inline) && (end == start || size+inline[end].size() <= inlineBatchLimit); end++ {
			d := inline[end]
			size += d.size()
			g := group[d.doc.ID]
			g.Missing = append(g.Missing, d.doc.Rev)
			group[d.doc.ID] = g
		}
		start = end
		got, s, err := r.fetch(ctx, group, true)
		if err != nil {
			return 0, nil, nil, err
		}
		f, err := bulkDocs(ctx, r.tgt, got)
		if err != nil {
			return 0, nil, nil, err
		}
		written, failed, skipped = written+len(got)-len(f), append(failed, f...), append(skipped, s...)
	}
	return written, failed, skipped, nil
}

// size is the sum of the doc's attachment lengths.
func (a attachedDoc) size() int64 {
	var n int64
	for _, s := range a.atts {
		n += s.Length
	}
	return n
}

// targetLeaves returns the leaf revs the target holds of id (none for a missing doc).
func targetLeaves(ctx context.Context, tgt *endpoint, id string) ([]string, error) {
	var ans openRevsAnswer
	err := tgt.do(ctx, http.MethodGet, tgt.docPath(id), url.Values{"open_revs": {"all"}}, nil, &ans)
	if errors.Is(err, couch.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read leaves of %q on %s: %w", id, tgt.shown, err)
	}
	var revs []string
	for _, d := range ans {
		var meta struct {
			Rev string `json:"_rev"`
		}
		if len(d.OK) > 0 && json.Unmarshal(d.OK, &meta) == nil && meta.Rev != "" {
			revs = append(revs, meta.Rev)
		}
	}
	return revs, nil
}
