// Package replicate is a native implementation of the CouchDB replication protocol: one-shot
// replication of a db to another (same or different server, CouchDB 2+/3 or PouchDB Server),
// with CouchDB-style checkpoints in `_local/<replication id>` on both sides, so that a run
// resumes where the last one (or a killed one) left off.
//
// One run: read both checkpoints and find the latest common session; read the source's
// _changes (style=all_docs) from there in batches; ask the target which leaf revs it lacks
// (_revs_diff); fetch them with their revision history and attachment stubs through _bulk_get
// (or GET ?open_revs= where _bulk_get is missing); write them with _bulk_docs and
// new_edits=false. Deletions and conflicts replicate: afterwards the target holds every leaf
// revision the source held when its change was read.
//
// Attachments: a revision with attachments keeps as stubs those the target already holds (in
// a possible ancestor named by _revs_diff, or, for a large revision on a server that names
// none, such as PouchDB Server, in one of the target's leaves: the atts_since rule applied
// here). If it needs at most 256 KiB of attachments, it is fetched again with them inline
// (base64) in a batched _bulk_get; a larger one is streamed from GETs of its attachments to a
// multipart/related PUT with new_edits=false, one revision at a time, without holding an
// attachment in memory. A target that refuses the multipart PUT (415) or a stub (412) gets the
// revision inline instead.
//
// Not done: continuous replication, JS filter functions evaluated locally, and atts_since
// sent to the source (PouchDB Server ignores it; the inline refetch carries every attachment
// of the revision).
package replicate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// Defaults of Options.
const (
	DefaultBatchSize          = 500
	DefaultWorkers            = 4
	DefaultCheckpointInterval = 5 * time.Second
)

// ErrSourceNotFound matches (errors.Is) the error of a run whose source db does not exist; the
// message names the source with its password redacted.
var ErrSourceNotFound = errors.New("source db not found")

// ErrTargetNotFound matches the error of a run whose target db does not exist and
// Options.CreateTarget is false; the message names the target with its password redacted.
var ErrTargetNotFound = errors.New("target db not found")

// ErrFenced matches the error of a run whose checkpoint write found that another run of the same
// replication wrote the checkpoint since this run read it (a newer holder of the job, after this
// one's lease ran out). The run stops without writing; the write is not retried.
var ErrFenced = errors.New("fenced: another run wrote the replication's checkpoint since this run read it")

// Fence holds a fencing token per replication id, kept where a compare-and-set is possible
// (the replicator consumer keeps it in NATS key-value). Safe for concurrent use.
type Fence interface {
	// Token returns the current token of replication id (0: none yet).
	Token(ctx context.Context, id string) (uint64, error)
	// Advance replaces token by a new one, which it returns, if the replication's token is
	// still token; otherwise it returns ok false (another run advanced it since).
	Advance(ctx context.Context, id string, token uint64) (next uint64, ok bool, err error)
}

// Options describe one replication.
type Options struct {
	// Source and Target are full db URLs, e.g. http://user:pw@host:5984/db (the last path
	// segment, URL-decoded, is the db name). Credentials are sent as Basic auth, never logged,
	// and are not part of the replication id.
	Source, Target string
	// CreateTarget creates a missing target db instead of failing with ErrTargetNotFound.
	CreateTarget bool
	// Filter is a server-side filter ("ddoc/name", "_view", ...) with QueryParams as its query
	// parameters (strings as they are, other values as JSON). DocIDs (filter=_doc_ids) and
	// Selector (filter=_selector; evaluated locally on PouchDB Server, on the winning revision)
	// exclude each other and Filter.
	Filter      string
	QueryParams map[string]any
	DocIDs      []string
	Selector    map[string]any
	// BatchSize is the number of changes per batch (default 500).
	BatchSize int
	// Workers is the number of batches processed in parallel (default 4).
	Workers int
	// CheckpointInterval is the least time between two checkpoints (default 5s); a run always
	// checkpoints at its end, and on cancellation records what was completed.
	CheckpointInterval time.Duration
	// Checkpoints, when set, caches the checkpoint docs between runs of this process (share
	// one between runs): a run that finds its replication there reads no checkpoint.
	Checkpoints *CheckpointCache
	// CheckpointDefer batches the checkpoints of a burst of small runs: a run that completes
	// within one batch of changes, less than CheckpointDefer after the previous checkpoint of
	// the same replication, skips its final checkpoint (two PUTs). The next run then starts at
	// that older checkpoint and re-reads the skipped changes, which _revs_diff finds present:
	// a few rows of extra reading, nothing written twice. So a replication writes at most one
	// checkpoint per CheckpointDefer while its runs stay small. 0 (the default) checkpoints
	// at the end of every run that replicated something.
	CheckpointDefer time.Duration
	// CheckpointDeferChanges, with CheckpointDefer, also defers the final checkpoint of a small
	// run after an older checkpoint, while the changes read past the checkpoint both sides hold
	// (by this run and the deferred ones before it) are fewer than CheckpointDeferChanges: a
	// db written now and then would otherwise pay two PUTs for nearly every change. A later run
	// that starts from the checkpoint re-reads at most that many changes. 0: off.
	CheckpointDeferChanges int
	// Fence, when set, orders the checkpoint writes of the runs of a replication: a run reads
	// the replication's token when it starts and advances it before every checkpoint write;
	// when another run advanced it since, the write is not made and the run ends with
	// ErrFenced. Apache CouchDB does not check the revs of _local docs, so without a Fence a
	// stale run (one whose job lease ran out while it still runs) could write its checkpoint
	// over a newer run's there; PouchDB Server refuses such a write by its rev.
	Fence Fence
	// HTTPClient is used for every request when set (share it between runs to reuse
	// connections; keep compression off for PouchDB Server). Its transport is wrapped, not
	// modified, to count requests.
	HTTPClient *http.Client
	// StreamHTTPClient carries the attachment reads that run while a multipart write to the
	// target holds its connection (couch.Client.SendStream). When HTTPClient caps its
	// connections per host, this one must not, or attachments could deadlock the two; default
	// HTTPClient.
	StreamHTTPClient *http.Client

	// noFirstGeneration turns the first-generation shortcut off (see firstGeneration): every
	// missing revision is fetched with _bulk_get, as before it (benchmarks compare).
	noFirstGeneration bool
}

func (o Options) withDefaults() Options {
	if o.BatchSize <= 0 {
		o.BatchSize = DefaultBatchSize
	}
	if o.Workers <= 0 {
		o.Workers = DefaultWorkers
	}
	if o.CheckpointInterval <= 0 {
		o.CheckpointInterval = DefaultCheckpointInterval
	}
	return o
}

// Validate checks what Run checks before it starts: source and target given; filter, doc_ids
// and selector not combined.
func (o Options) Validate() error {
	if o.Source == "" || o.Target == "" {
		return errors.New("replicate: source and target are required")
	}
	n := 0
	if len(o.DocIDs) > 0 {
		n++
	}
	if o.Selector != nil {
		n++
	}
	if o.Filter != "" && o.Filter != "_doc_ids" && o.Filter != "_selector" {
		n++
	}
	switch {
	case n > 1:
		return errors.New("replicate: filter, doc_ids and selector exclude each other")
	case o.Filter == "_doc_ids" && len(o.DocIDs) == 0:
		return errors.New("replicate: filter _doc_ids needs doc_ids")
	case o.Filter == "_selector" && o.Selector == nil:
		return errors.New("replicate: filter _selector needs a selector")
	}
	return nil
}

// Result reports a run, with CouchDB's counters.
type Result struct {
	OK            bool
	NoChanges     bool   // the source had no change since the checkpoint: nothing was written
	SessionID     string // this run's session in the checkpoint history
	ReplicationID string
	StartSeq      string // where the run started ("" = the beginning)
	EndSeq        string // source_last_seq of the last checkpoint written (StartSeq if none)
	// FeedEnd is the last_seq of the source's changes feed where this run found its end: every
	// change up to it is on the target (or was refused by it, DocWriteFailures). Set on success;
	// it may be past EndSeq (a deferred checkpoint).
	FeedEnd string
	// CheckpointDeferred is true when the run replicated changes but left its final
	// checkpoint to a later run (Options.CheckpointDefer).
	CheckpointDeferred bool
	// DocsRead counts revisions fetched from the source, DocsWritten those the target stored,
	// DocWriteFailures those it refused; MissingChecked the leaf revs sent to _revs_diff,
	// MissingFound those the target lacked. A batch of new docs written without asking (see
	// run.process) counts its revisions as checked, missing and written.
	DocsRead, DocsWritten, DocWriteFailures, MissingChecked, MissingFound int64

	// Requests counts the HTTP requests the run sent, retries included.
	Requests int64
}

// Run replicates opt.Source to opt.Target once, up to the end of the source's changes feed as
// read during the run, and returns the counters. Per-doc write failures are counted and logged,
// not errors. Checkpoints are written only for changes whose docs are all stored on the target,
// so a run killed at any moment loses at most the work since its last checkpoint; on ctx
// cancellation Run still records the completed work (bounded by a short timeout) and returns
// an error wrapping ctx's. A missing source is ErrSourceNotFound; a missing target without
// CreateTarget ErrTargetNotFound. Run is safe to call concurrently for different replications;
// two concurrent runs of the same replication are safe for the data but contend for the
// checkpoint. The Result is filled as far as the run went, even with an error.
func Run(ctx context.Context, opt Options, log logrus.FieldLogger) (Result, error) {
	if log == nil {
		l := logrus.New()
		l.SetOutput(io.Discard)
		log = l
	}
	opt = opt.withDefaults()
	if err := opt.Validate(); err != nil {
		return Result{}, err
	}
	var requests atomic.Int64
	tr, release, err := countingTransportOf(opt.HTTPClient, &requests)
	if err != nil {
		return Result{}, fmt.Errorf("replicate: %w", err)
	}
	defer release()
	streamTr := tr
	if opt.StreamHTTPClient != nil && opt.StreamHTTPClient.Transport != nil {
		streamTr = countingTransport{base: opt.StreamHTTPClient.Transport, n: &requests}
	}
	src, err := newEndpoint(opt.Source, tr, streamTr)
	if err != nil {
		return Result{}, fmt.Errorf("replicate: source: %w", err)
	}
	tgt, err := newEndpoint(opt.Target, tr, streamTr)
	if err != nil {
		return Result{}, fmt.Errorf("replicate: target: %w", err)
	}
	r := &run{opt: opt, src: src, tgt: tgt}
	code, err := r.filterCode(ctx)
	var res Result
	if err == nil {
		r.id = ReplicationID(opt, code)
		r.log = log.WithFields(logrus.Fields{
			"component": "replicate", "source": src.shown, "target": tgt.shown, "replication_id": r.id,
		})
		res, err = r.run(ctx)
	}
	res.Requests = requests.Load()
	st := r.counters.snapshot()
	res.DocsRead, res.DocsWritten, res.DocWriteFailures = st.DocsRead, st.DocsWritten, st.DocWriteFailures
	res.MissingChecked, res.MissingFound = st.MissingChecked, st.MissingFound
	if err != nil {
		return res, fmt.Errorf("replicate %s to %s: %w", src.shown, tgt.shown, err)
	}
	return res, nil
}

// run is the state of one Run.
type run struct {
	opt       Options
	src, tgt  *endpoint
	id        string
	log       logrus.FieldLogger
	counters  counters
	bulkGetOK bulkGetProbe // whether the source has _bulk_get, found out once per run
	// blind lets a small batch of new docs skip _revs_diff (see process): the run continues
	// this process's own progress (a cached checkpoint)
	blind bool
}

func (r *run) run(ctx context.Context) (Result, error) {
	cp := &checkpointer{src: r.src, tgt: r.tgt, id: r.id, session: newSessionID(), started: time.Now()}
	res := Result{SessionID: cp.session, ReplicationID: r.id}
	var err error
	if r.opt.Fence != nil {
		// The run's fencing token is read before anything of the checkpoints.
		if cp.token, err = r.opt.Fence.Token(ctx, r.id); err != nil {
			return res, fmt.Errorf("read the fencing token: %w", err)
		}
		cp.fence = r.opt.Fence
	}
	srcDoc, tgtDoc, done, cached := r.opt.Checkpoints.get(r.id)
	if !cached {
		if srcDoc, tgtDoc, err = r.readCheckpoints(ctx, cp); err != nil {
			return res, err
		}
	}
	pouchDB := false
	if r.opt.Selector != nil {
		if pouchDB, err = r.isPouchDB(ctx); err != nil {
			return res, err
		}
	}
	reader, err := newChangesReader(r.src, r.opt, pouchDB)
	if err != nil {
		return res, err
	}
	for restarts := 0; ; {
		r.startFrom(cp, &res, srcDoc, tgtDoc, done)
		// Changes past this process's own progress are new to the target: a small batch of new
		// docs is written without asking _revs_diff (see process).
		r.blind = cached
		cp.check = nil
		if cached {
			cp.check = r.targetCheck(ctx, cp, tgtDoc)
		}
		err = r.replicate(ctx, reader, cp, &res, cached, srcDoc, tgtDoc)
		if !errors.Is(err, errTargetChanged) || restarts >= maxRestarts {
			return res, err
		}
		restarts++
		// The target is not as this process left it: deleted and recreated, restored from a
		// backup, or replicated by another process since. Both checkpoints are read again, as a
		// run without the cache does (CouchDB's replicator starts over when the target's
		// checkpoint is gone). What the run wrote before it found out is on the target either way.
		r.log.WithError(err).Info("the target's checkpoint is not the cached one (target deleted, recreated or restored, or another process ran): reading both checkpoints")
		cached, done = false, progress{}
		if srcDoc, tgtDoc, err = r.readCheckpoints(ctx, cp); err != nil {
			return res, err
		}
	}
}

// gone explains a 404 in the middle of a run (a _changes, _bulk_get, _revs_diff or _bulk_docs
// answered that the db does not exist): the source or the target was deleted after the run read
// its checkpoints, or since the cached ones. A missing source is ErrSourceNotFound; a missing
// target is errTargetChanged, so that the run starts again from reading both checkpoints, which
// creates the target with CreateTarget or returns ErrTargetNotFound; a db that said it does not
// exist and exists again was deleted and created again meanwhile: errTargetChanged too. When
// CouchDB cannot be asked (a connection cut), the db's 404 is no verdict: the error is the
// question's, and the run is retried. Anything else keeps err.
func (r *run) gone(ctx context.Context, err error) error {
	srcOK, srcErr := r.src.exists(ctx)
	if srcErr == nil && !srcOK {
		return fmt.Errorf("%w: %s", ErrSourceNotFound, r.src.shown)
	}
	tgtOK, tgtErr := r.tgt.exists(ctx)
	if tgtErr == nil && !tgtOK {
		return fmt.Errorf("target %s deleted during the run: %w", r.tgt.shown, errTargetChanged)
	}
	var he *couch.HTTPError
	switch {
	case !errors.As(err, &he) || !he.DBMissing():
		return err
	case srcErr != nil || tgtErr != nil:
		return fmt.Errorf("%s, and which db is gone could not be asked: %w", err, errors.Join(srcErr, tgtErr))
	}
	return fmt.Errorf("a db deleted and created again during the run (%w): %w", err, errTargetChanged)
}

// maxRestarts bounds how often one run starts again from reading both checkpoints (see
// errTargetChanged): a server whose answers keep contradicting each other gets an error, which
// the caller retries later.
const maxRestarts = 3

// errTargetChanged is the verification's finding that the target's checkpoint doc is not the
// cached one (see targetCheck), or a run's that its target was deleted (see gone); the run
// starts again without the cache.
var errTargetChanged = errors.New("the target's checkpoint is not the cached one")

// targetCheck returns the verification of a cached checkpoint, never trusted (see
// CheckpointCache): a func that reads the target's checkpoint doc and returns errTargetChanged
// when it is not tgtDoc. The checkpointer calls it before the run's first checkpoint write, and
// the run before it reports success; a run's writes before it are of changes the target needs
// either way. When the target is on another server its doc is read now, while the first page is;
// on the source's server when first called: after the run's writes, so that the doc written is
// on the target one round trip sooner, and the run holds one connection at a time.
func (r *run) targetCheck(ctx context.Context, cp *checkpointer, tgtDoc *checkpointDoc) func(context.Context) error {
	compare := func(doc *checkpointDoc, err error) error {
		switch {
		case err != nil:
			return err
		case !sameCheckpoint(doc, tgtDoc):
			return errTargetChanged
		}
		return nil
	}
	if r.src.sameServer(r.tgt) {
		return func(ctx context.Context) error { return compare(cp.read(ctx, r.tgt)) }
	}
	read := make(chan verifyResult, 1)
	go func() {
		doc, err := cp.read(ctx, r.tgt)
		read <- verifyResult{doc, err}
	}()
	var got *verifyResult
	return func(ctx context.Context) error {
		if got == nil {
			select {
			case v := <-read:
				got = &v
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return compare(got.doc, got.err)
	}
}

// replicate is one attempt of the run from cp's start: the first page, then the pipeline; it
// updates the cache with the outcome. errTargetChanged means that the cached checkpoint was
// stale: the caller starts again without it.
func (r *run) replicate(ctx context.Context, reader *changesReader, cp *checkpointer, res *Result, cached bool, srcDoc, tgtDoc *checkpointDoc) error {
	first, raw, err := reader.page(ctx, cp.startSeq)
	if err != nil {
		r.opt.Checkpoints.drop(r.id)
		err = fmt.Errorf("read changes of %s: %w", r.src.shown, err)
		if errors.Is(err, couch.ErrNotFound) {
			return r.gone(ctx, err)
		}
		return err
	}
	if raw == 0 {
		if err := cp.verify(ctx); err != nil {
			r.opt.Checkpoints.drop(r.id)
			return err
		}
		res.OK, res.NoChanges, res.FeedEnd = true, true, string(first.LastSeq)
		if res.FeedEnd == "" {
			res.FeedEnd = string(cp.startSeq)
		}
		r.log.WithField("seq", res.StartSeq).Debug("no changes since the checkpoint")
		if !cached && srcDoc != nil && tgtDoc != nil {
			r.opt.Checkpoints.put(r.id, *srcDoc, *tgtDoc)
		}
		return nil
	}
	err = r.pipeline(ctx, reader, first, raw, cp)
	if err == nil {
		err = cp.verify(ctx) // a run that wrote no checkpoint has not verified yet
	}
	if errors.Is(err, couch.ErrNotFound) {
		err = r.gone(ctx, err)
	}
	switch {
	case err != nil:
		r.opt.Checkpoints.drop(r.id)
	case cp.lastWritten != nil:
		r.opt.Checkpoints.put(r.id, cp.lastWritten.withRev(cp.srcRev), cp.lastWritten.withRev(cp.tgtRev))
	case cp.deferred:
		if !cached && srcDoc != nil && tgtDoc != nil { // both sides still hold what was read
			r.opt.Checkpoints.put(r.id, *srcDoc, *tgtDoc)
		}
		r.opt.Checkpoints.advance(r.id, progress{cp.deferredSeq, cp.deferredChanges})
	}
	res.EndSeq, res.CheckpointDeferred, res.FeedEnd = string(cp.written), cp.deferred, string(cp.feedEnd)
	res.OK = err == nil
	if err != nil {
		return err // the caller logs it
	}
	st := r.counters.snapshot()
	log := r.log.WithFields(logrus.Fields{
		"seq": res.EndSeq, "docs_read": st.DocsRead, "docs_written": st.DocsWritten,
		"doc_write_failures": st.DocWriteFailures, "missing_found": st.MissingFound,
	})
	if st.DocsWritten > 0 || st.DocWriteFailures > 0 {
		log.Info("replicated")
	} else {
		log.Debug("replicated: target was up to date")
	}
	return nil
}

// startFrom sets where cp's run starts from the checkpoint docs read (nil: none) and the
// progress of earlier deferred runs (zero if none).
func (r *run) startFrom(cp *checkpointer, res *Result, srcDoc, tgtDoc *checkpointDoc, done progress) {
	cp.startSeq, cp.history = findStartSeq(srcDoc, tgtDoc)
	cp.written, cp.deferredBefore = cp.startSeq, 0
	cp.deferred, cp.deferredSeq, cp.deferredChanges, cp.lastWritten, cp.feedEnd = false, "", 0, nil, "" // an earlier attempt's
	if done.seq != "" {
		// An earlier run of this process left its checkpoint to a later run: everything up to
		// its progress is on the target already.
		cp.startSeq, cp.written, cp.deferredBefore = done.seq, done.seq, done.changes
	}
	cp.lastSession, cp.srcRev, cp.tgtRev = "", "", ""
	if srcDoc != nil && tgtDoc != nil && srcDoc.SessionID == tgtDoc.SessionID {
		cp.lastSession = srcDoc.SessionID
	}
	if srcDoc != nil {
		cp.srcRev = srcDoc.Rev
	}
	if tgtDoc != nil {
		cp.tgtRev = tgtDoc.Rev
	}
	res.StartSeq, res.EndSeq = string(cp.startSeq), string(cp.startSeq)
}

// verifyResult is the target's checkpoint doc as read to verify a cached one.
type verifyResult struct {
	doc *checkpointDoc
	err error
}

// sameCheckpoint reports whether the doc read (nil: none) is the cached one: same rev, session
// and seq. A recreated target has none, or one a later run wrote; a restored one an older one.
func sameCheckpoint(read, cached *checkpointDoc) bool {
	if read == nil || cached == nil {
		return read == cached
	}
	return read.Rev == cached.Rev && read.SessionID == cached.SessionID && read.SourceLastSeq == cached.SourceLastSeq
}

// readCheckpoints reads both checkpoint docs in parallel. A side without one is checked for
// existence (the only db reads a run makes, and only then), unless the answer said the db
// exists (see readInDB: a first run of a replication, e.g. every db of an initial sync, then
// costs two requests, not four): a missing source is ErrSourceNotFound; a missing target is
// created with CreateTarget, else ErrTargetNotFound.
func (r *run) readCheckpoints(ctx context.Context, cp *checkpointer) (src, tgt *checkpointDoc, err error) {
	var wg sync.WaitGroup
	var srcErr, tgtErr error
	wg.Add(2)
	go func() {
		defer wg.Done()
		var inDB bool
		if src, inDB, srcErr = cp.readInDB(ctx, r.src); srcErr != nil || inDB {
			return
		}
		ok, err := r.src.exists(ctx)
		switch {
		case err != nil:
			srcErr = err
		case !ok:
			srcErr = fmt.Errorf("%w: %s", ErrSourceNotFound, r.src.shown)
		}
	}()
	go func() {
		defer wg.Done()
		var inDB bool
		if tgt, inDB, tgtErr = cp.readInDB(ctx, r.tgt); tgtErr != nil || inDB {
			return
		}
		ok, err := r.tgt.exists(ctx)
		switch {
		case err != nil:
			tgtErr = err
		case !ok && r.opt.CreateTarget:
			tgtErr = r.tgt.create(ctx)
		case !ok:
			tgtErr = fmt.Errorf("%w: %s", ErrTargetNotFound, r.tgt.shown)
		}
	}()
	wg.Wait()
	if srcErr != nil { // the source's error first: a missing source explains the rest
		return nil, nil, srcErr
	}
	return src, tgt, tgtErr
}

// isPouchDB tells whether the source server is PouchDB Server (its welcome doc, read once).
func (r *run) isPouchDB(ctx context.Context) (bool, error) {
	info, err := r.src.c.Server(ctx)
	if err != nil {
		return false, err
	}
	return info.PouchDB, nil
}
