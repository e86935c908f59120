package replicate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// blindBatch is the most rows of a batch of new docs written without asking _revs_diff (see
// process): what a wrong guess can send for nothing, against the round trip it saves on every
// small run (most runs of a user db are a few new docs).
const blindBatch = 20

// maxLoggedPerBatch bounds the per-doc warnings (refused, skipped) logged for one batch.
const maxLoggedPerBatch = 10

// flushTimeout bounds the checkpoint written after a run was cancelled or failed.
const flushTimeout = 10 * time.Second

// stats are CouchDB's replication counters.
type stats struct {
	MissingChecked, MissingFound, DocsRead, DocsWritten, DocWriteFailures int64
}

// counters are the stats of a run, updated by its workers.
type counters struct {
	missingChecked, missingFound, docsRead, docsWritten, docWriteFailures atomic.Int64
}

func (c *counters) snapshot() stats {
	return stats{
		MissingChecked:   c.missingChecked.Load(),
		MissingFound:     c.missingFound.Load(),
		DocsRead:         c.docsRead.Load(),
		DocsWritten:      c.docsWritten.Load(),
		DocWriteFailures: c.docWriteFailures.Load(),
	}
}

func newSessionID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// batch is one page of changes; idx orders batches for checkpointing.
type batch struct {
	idx     int
	rows    []change
	lastSeq couch.Seq
}

// batchDone reports a processed batch to the coordinator.
type batchDone struct {
	idx     int
	lastSeq couch.Seq
	err     error
}

// pipeline replicates from the first page on: one goroutine reads the following pages ahead,
// Workers goroutines process batches in parallel, and this goroutine checkpoints the last seq
// of the longest prefix of completed batches (so a checkpoint never covers a batch still in
// flight), at most every CheckpointInterval and once at the end. The first error stops it all;
// completed work is still checkpointed.
func (r *run) pipeline(parent context.Context, reader *changesReader, first changesPage, firstRaw int, cp *checkpointer) error {
	ctx, cancel := context.WithCancelCause(parent)
	defer cancel(nil)
	batches := make(chan batch, r.opt.Workers)
	results := make(chan batchDone, r.opt.Workers)

	go func() {
		defer close(batches)
		p, raw := first, firstRaw
		for idx := 0; ; idx++ {
			select {
			case batches <- batch{idx: idx, rows: p.Results, lastSeq: p.LastSeq}:
			case <-ctx.Done():
				return
			}
			if raw < r.opt.BatchSize {
				return // a short page is the end of the feed
			}
			var err error
			if p, raw, err = reader.page(ctx, p.LastSeq); err != nil {
				cancel(fmt.Errorf("read changes of %s: %w", r.src.shown, err))
				return
			}
			if raw == 0 {
				return
			}
		}
	}()

	var wg sync.WaitGroup
	for range r.opt.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range batches {
				err := r.process(ctx, b)
				if err != nil {
					cancel(err)
				}
				results <- batchDone{idx: b.idx, lastSeq: b.lastSeq, err: err}
			}
		}()
	}
	go func() { wg.Wait(); close(results) }()

	done := map[int]couch.Seq{}
	next, recorded, last := 0, cp.written, time.Now()
	for d := range results {
		if d.err != nil {
			continue
		}
		done[d.idx] = d.lastSeq
		for {
			s, ok := done[next]
			if !ok {
				break
			}
			delete(done, next)
			next++
			recorded = s
		}
		if ctx.Err() == nil && recorded != cp.written && time.Since(last) >= r.opt.CheckpointInterval {
			if err := cp.write(ctx, recorded, r.counters.snapshot()); err != nil {
				cancel(err)
				continue
			}
			last = time.Now()
			r.log.WithField("seq", string(recorded)).Debug("checkpoint written")
		}
	}

	// nil unless a part failed or parent ended (cancel(nil) is deferred); a fenced run writes
	// nothing more: another run holds the checkpoint; nor does a run whose cached checkpoint
	// turned out stale: it starts again.
	err := context.Cause(ctx)
	if err == nil { // the reader stops without an error at the end of the feed only
		cp.feedEnd = recorded
	}
	if recorded == cp.written || errors.Is(err, ErrFenced) || errors.Is(err, errTargetChanged) {
		return err
	}
	if err == nil && next == 1 && (cp.recent(r.opt.CheckpointDefer) || r.opt.CheckpointDefer > 0 && cp.fewSince(r.opt.CheckpointDeferChanges, firstRaw)) {
		cp.deferred, cp.deferredSeq, cp.deferredChanges = true, recorded, cp.deferredBefore+firstRaw
		r.log.WithField("seq", string(recorded)).Debug("checkpoint deferred: the last one is recent or few changes behind, and this run was small")
		return nil
	}
	wctx := ctx
	if err != nil {
		var stop context.CancelFunc
		wctx, stop = context.WithTimeout(context.WithoutCancel(parent), flushTimeout)
		defer stop()
	}
	if werr := cp.write(wctx, recorded, r.counters.snapshot()); werr != nil {
		return errors.Join(err, werr)
	}
	return err
}

// process replicates one batch: _revs_diff, fetch (attachments as stubs), _bulk_docs for the
// docs without attachments, then transferAttachments for the others. The missing
// first-generation revisions the page carried whole are not fetched (firstGeneration): a batch
// of new docs is _revs_diff and _bulk_docs. A batch of at most blindBatch rows that are all
// such revisions is not even asked about in a blind run (one that continues this process's own
// progress): the target lacks them unless another process replicated them since, and
// _bulk_docs with new_edits=false leaves a revision that the target holds as it is, so a wrong
// guess costs the docs' bytes, not a write. Its revisions count as missing and written. It
// returns only when every fetched doc was written or refused by the target, or with an error.
func (r *run) process(ctx context.Context, b batch) error {
	if len(b.rows) == 0 {
		return nil
	}
	revs := make(map[string][]string, len(b.rows))
	whole := map[string]fetchedDoc{} // first-generation revisions the page carried whole (firstGeneration)
	var checked int64
	for _, c := range b.rows {
		if d, ok := firstGeneration(c); ok {
			whole[c.ID] = d
		}
		for _, ch := range c.Changes {
			revs[c.ID] = append(revs[c.ID], ch.Rev)
			checked++
		}
	}
	r.counters.missingChecked.Add(checked)
	var missing map[string]revsDiff
	var direct []fetchedDoc
	var found int64
	if r.blind && len(b.rows) <= blindBatch && len(whole) == len(b.rows) {
		for _, c := range b.rows {
			direct = append(direct, whole[c.ID])
		}
		found = checked
	} else {
		var err error
		if missing, err = missingRevs(ctx, r.tgt, revs); err != nil {
			return err
		}
		for id, d := range missing {
			found += int64(len(d.Missing))
			if w, ok := whole[id]; ok && len(d.Missing) == 1 && d.Missing[0] == w.Rev {
				direct = append(direct, w)
				delete(missing, id)
			} else if len(d.Missing) == 0 {
				delete(missing, id)
			}
		}
	}
	r.counters.missingFound.Add(found)
	if found == 0 {
		return nil
	}
	docs := direct
	var skipped []skippedRev
	if len(missing) > 0 {
		fetched, s, err := r.fetch(ctx, missing, false)
		if err != nil {
			return err
		}
		docs, skipped = append(docs, fetched...), s
	}
	r.counters.docsRead.Add(int64(len(docs)))
	plain, withAtts := splitAttachments(docs)
	failed, err := bulkDocs(ctx, r.tgt, plain)
	if err != nil {
		return err
	}
	written := len(plain) - len(failed)
	if len(withAtts) > 0 {
		w, f, s, err := r.transferAttachments(ctx, withAtts, missing)
		if err != nil {
			return err
		}
		written, failed, skipped = written+w, append(failed, f...), append(skipped, s...)
	}
	for i, s := range skipped {
		if i == maxLoggedPerBatch {
			r.log.WithField("count", len(skipped)).Warn("more revisions skipped in this batch")
			break
		}
		r.log.WithFields(map[string]any{"doc": s.ID, "rev": s.Rev, "reason": s.Reason}).
			Warn("source could not return a missing revision; skipped")
	}
	r.counters.docsWritten.Add(int64(written))
	r.counters.docWriteFailures.Add(int64(len(failed)))
	for i, f := range failed {
		if i == maxLoggedPerBatch {
			r.log.WithField("count", len(failed)).Warn("more documents refused in this batch")
			break
		}
		r.log.WithFields(map[string]any{"doc": f.ID, "rev": f.Rev, "error": f.Error, "reason": f.Reason}).
			Warn("target refused a document")
	}
	return nil
}

// bulkGetProbe is whether a run's source has _bulk_get. mu is held by the first fetch of the
// run, which tries _bulk_get and so finds out; the batches fetched in parallel wait for the
// answer instead of trying too. known is set once it is known; unsupported is the answer.
type bulkGetProbe struct {
	mu                 sync.Mutex
	known, unsupported atomic.Bool
}

// fetch reads the missing revs from the source (fetchRevs) and makes sure each answer is a
// revision asked for (asked): one that is not fails the batch, and nothing of it is written.
func (r *run) fetch(ctx context.Context, missing map[string]revsDiff, withAttachments bool) ([]fetchedDoc, []skippedRev, error) {
	docs, skipped, err := r.fetchRevs(ctx, missing, withAttachments)
	if err != nil {
		return nil, nil, err
	}
	for _, d := range docs {
		if err := asked(d, missing[d.ID]); err != nil {
			return nil, nil, fmt.Errorf("fetch from %s: %w: nothing of this batch is written", r.src.shown, err)
		}
	}
	return docs, skipped, nil
}

// errNotAsked is a fetched revision that answers none of the revisions asked for its doc.
var errNotAsked = errors.New("the source answered a revision that was not asked for")

// asked reports, as an error, when d is not one of the revisions asked for its doc (d.Missing)
// nor a descendant of one (the fetch asks for the latest leaf: its history holds the rev
// asked for). Whatever answer that is, a mix-up somewhere between the source and this run,
// writing it would put another db's revision into the target.
func asked(d fetchedDoc, want revsDiff) error {
	var h struct {
		Revisions struct {
			Start int      `json:"start"`
			IDs   []string `json:"ids"`
		} `json:"_revisions"`
	}
	if err := json.Unmarshal(d.Body, &h); err != nil {
		return fmt.Errorf("%w: %q %s: %v", errNotAsked, d.ID, d.Rev, err)
	}
	for _, rev := range want.Missing {
		gen, hash, ok := strings.Cut(rev, "-")
		n, err := strconv.Atoi(gen)
		if !ok || err != nil {
			continue
		}
		if i := h.Revisions.Start - n; i >= 0 && i < len(h.Revisions.IDs) && h.Revisions.IDs[i] == hash {
			return nil
		}
	}
	return fmt.Errorf("%w: %q %s, asked for %v", errNotAsked, d.ID, d.Rev, want.Missing)
}

// fetchRevs reads the missing revs from the source with _bulk_get, or with open_revs once the
// source turned out to lack _bulk_get; attachments inline with withAttachments, else as stubs.
// Whether it has _bulk_get is found out once per run: the first fetch tries it while the
// others wait (batches are fetched in parallel), so a source without it is asked once.
func (r *run) fetchRevs(ctx context.Context, missing map[string]revsDiff, withAttachments bool) ([]fetchedDoc, []skippedRev, error) {
	p := &r.bulkGetOK
	if !p.known.Load() {
		p.mu.Lock()
		if !p.known.Load() {
			docs, skipped, unsupported, err := bulkGet(ctx, r.src, missing, withAttachments)
			if err == nil || unsupported {
				// A failed request leaves the question open for the next fetch.
				p.unsupported.Store(unsupported)
				p.known.Store(true)
			}
			p.mu.Unlock()
			if !unsupported {
				return docs, skipped, err
			}
			r.log.Info("source lacks _bulk_get: fetching with open_revs")
			return openRevs(ctx, r.src, missing, withAttachments, r.opt.Workers)
		}
		p.mu.Unlock()
	}
	if !p.unsupported.Load() {
		docs, skipped, unsupported, err := bulkGet(ctx, r.src, missing, withAttachments)
		if !unsupported {
			return docs, skipped, err
		}
		p.unsupported.Store(true)
	}
	return openRevs(ctx, r.src, missing, withAttachments, r.opt.Workers)
}
