package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
	"github.com/spiegel-nats/spiegel/pkg/webhook"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

const (
	// defaultInlineRetry is the longest retry delay a job waits for itself; a request due later
	// is deferred: its rule stops at that change and the job is run again later, so a webhook
	// that is down does not hold a job slot for the whole backoff.
	defaultInlineRetry = 10 * time.Second
	// defaultMaxDefer caps the delay of a job whose rule deferred a request, so that the other
	// rules of the db see their new changes soon even while one rule waits for a long backoff.
	defaultMaxDefer = 30 * time.Second
)

// errNoStream is the status of a subject rule whose subject no stream captures.
var errNoStream = errors.New("no stream captures the rule's subject")

// ruleSource is the live rule set (*rules.Set).
type ruleSource interface {
	OnChanges(db string) []*rules.OnChange
	Rule(id string) (rules.Rule, bool)
}

// deadLetterer stores dead-letter records (*worker.DeadLetters).
type deadLetterer interface {
	Publish(ctx context.Context, rec worker.DeadLetter) error
}

// handler runs the on_change rules of a db for one job (SPEC §5.3). It is safe for concurrent
// use by many jobs; the runner guarantees one job per db at a time.
type handler struct {
	couch     *couch.Client
	store     *checkpoint.OnChangeStore
	rules     ruleSource
	hooks     *webhook.Client
	publisher *changePublisher
	mirrors   *mirrorWriter
	dead      deadLetterer
	metrics   *metrics.Consumer
	status    *status.Recorder // may be nil
	log       logrus.FieldLogger

	batchSize          int
	requestConcurrency int
	inlineRetry        time.Duration
	maxDefer           time.Duration
	book               *retryBook
	gaps               *expiringSet // the gaps reported (see reportGap), so that each is reported once
}

// newHandler wires a handler from an opened consumer app and the binary's config.
func newHandler(app consumer.Deps, cfg *config.OnChange) *handler {
	return &handler{
		couch: app.Couch, store: app.Checkpoints, rules: app.Rules, dead: app.DeadLetters, metrics: app.Metrics, status: app.Status,
		log: app.Log.WithField("component", "onchange"),
		hooks: webhook.New(webhook.Config{
			Timeout: cfg.WebhookTimeout, AllowedHosts: cfg.AllowedHosts, Passwords: app.Passwords,
			SignatureSecrets: cfg.SignatureSecrets, Metrics: app.Metrics,
			MaxParallel: max(cfg.Concurrency, 1) * max(cfg.RequestConcurrency, 1),
			Instance:    webhook.InstanceName(),
		}),
		publisher:          newChangePublisher(app.JS, app.Metrics, events.NewSubjects(cfg.SubjectPrefix)),
		mirrors:            newMirrorWriter(app.JS, cfg.StreamReplicas, app.JS.Conn().MaxPayload),
		batchSize:          max(cfg.BatchSize, 1),
		requestConcurrency: max(cfg.RequestConcurrency, 1),
		inlineRetry:        defaultInlineRetry,
		maxDefer:           defaultMaxDefer,
		book:               newRetryBook(),
		gaps:               newGapSet(),
	}
}

// ruleResult is how one rule's run in one db ended.
type ruleResult struct {
	seq      string // the rule's checkpoint when it stopped
	caughtUp bool   // every change up to the end of the feed was acted on
	end      string // with caughtUp: the feed's last_seq where the rule found its end
	retryIn  time.Duration
	deferErr error // why the rule deferred (with retryIn)
	err      error // a transient failure: the job must run again
	// outcome, when set, is the run's status result other than ok, error and deferred
	// (status.ResultMissingSource, or status.ResultFailed with why).
	outcome string
	why     error
}

// record tells the status recorder how rule's run ended.
func (h *handler) record(rule string, r ruleResult) {
	switch {
	case r.err != nil:
		h.status.RuleRun(rule, status.ResultError, r.err)
	case r.retryIn > 0:
		h.status.RuleRun(rule, status.ResultDeferred, r.deferErr)
	case r.outcome != "":
		h.status.RuleRun(rule, r.outcome, r.why)
	default:
		h.status.RuleRun(rule, status.ResultOK, nil)
	}
}

// handle is the worker.Handler of the onchange group. For every enabled rule that matches the
// job's db it runs, concurrently and independently, the changes after the rule's checkpoint
// (see runRule). A missing db acks the job with a warning. The result is:
//   - nil when every rule caught up (or stopped for a reason only a rule edit can fix): the
//     worker acks the job, then its lost-wakeup check (natsjs.Jobs.Offer) runs the db again if a
//     change came while the rules read the feed;
//   - worker.RetryAfter when a rule deferred a request whose retry is due later (capped at
//     maxDefer, so the other rules are not held back long);
//   - a transient error when CouchDB, the checkpoint store or the dead-letter stream failed.
func (h *handler) handle(ctx context.Context, job *worker.Job) error {
	rs := h.rules.OnChanges(job.DB)
	if len(rs) == 0 {
		return nil
	}
	ctx = withMirrorPoints(withFences(ctx)) // this job's view of the subjects and buckets it writes to (see fence.go, mirror.go)
	// Mirror rules claim the db in their buckets before anything of the db is read (see
	// mirrorWriter.claimDB); a bucket that cannot be claimed stops its rules only.
	claims := map[string]error{}
	for _, r := range rs {
		if _, done := claims[r.Mirror]; r.Mirror != "" && !done {
			claims[r.Mirror] = h.mirrors.claimDB(ctx, r.Mirror, job.DB, r.Timeout)
		}
	}
	size := h.pageSizer(rs)
	pages := newPageShare(ctx, len(rs), func(ctx context.Context, since string) pageRead {
		limit := size.next()
		page, err := h.couch.Changes(ctx, job.DB, couch.ChangesOptions{Since: since, Limit: limit, IncludeDocs: true})
		if err == nil {
			size.read(limit, page)
		}
		return pageRead{page, limit, err}
	})
	results := make([]ruleResult, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		if err := claims[r.Mirror]; err != nil {
			results[i] = ruleResult{err: fmt.Errorf("rule %s: %w", r.ID(), err)}
			continue
		}
		wg.Go(func() { results[i] = h.runRule(ctx, job.DB, r, pages.reader()) })
	}
	wg.Wait()
	for i, res := range results {
		h.record(rs[i].ID(), res)
		if res.caughtUp {
			reconcile.Vouch(ctx, res.end) // the completion record (reconcile.Recorder.Wrap)
		}
	}

	var errs []error
	var retryIn time.Duration
	var deferErr error
	for _, res := range results {
		switch {
		case res.err != nil:
			errs = append(errs, res.err)
		case res.retryIn > 0 && (retryIn == 0 || res.retryIn < retryIn):
			retryIn, deferErr = res.retryIn, res.deferErr
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if retryIn > 0 {
		return worker.RetryAfter(min(retryIn, h.maxDefer), deferErr)
	}
	return nil
}

// runRule acts on the changes of db after rule's checkpoint, one page of at most batchSize at a
// time, until a page is empty or short. After each page the checkpoint moves past the changes
// whose actions all succeeded or were dead-lettered, and never past one that is still due
// (feed order, at-least-once). The rule is looked up again before every page: an edit applies
// from the next page, a deleted or disabled rule stops.
//
// Page boundaries cost no waiting: while a full page is acted on, the next one is already being
// read, and a checkpoint is written while the next page is acted on. Only one checkpoint write
// is in flight at a time, and runRule returns only once the last one is stored (or failed: the
// result then names the last stored seq and the error).
func (h *handler) runRule(ctx context.Context, db string, rule *rules.OnChange, pages *pageReader) ruleResult {
	log := h.log.WithFields(logrus.Fields{"db": db, "rule": rule.ID()})
	cp, since, fresh, err := h.start(ctx, db, rule)
	if errors.Is(err, couch.ErrNotFound) {
		return h.dbGone(ctx, db, rule, log)
	}
	if err != nil {
		return ruleResult{err: err}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // stops a page read ahead that is not needed
	cps := &checkpointWriter{store: h.store, cp: cp, stored: since, fresh: fresh}
	h.book.seed(rule.ID(), db, cp.Retries) // requests deferred by whichever instance ran the rule before
	replay := replayOf(cp)
	finish := func(r ruleResult) ruleResult {
		if err := cps.wait(); err != nil {
			r = ruleResult{err: errors.Join(r.err, err)}
		}
		switch {
		case errors.Is(r.err, checkpoint.ErrFenced):
			log.Warn("another run or a replay wrote the checkpoint since this run read it: stopped without saving")
		case errors.Is(r.err, checkpoint.ErrMoved):
			log.Info("the checkpoint's db was deleted or recreated meanwhile: starting over")
		}
		r.seq = cps.stored
		return r
	}
	// A cached checkpoint is checked against its _local doc and the db's identity
	// (checkpoint.OnChangeStore.Verify), read while the first page is, before anything of that
	// page is acted on: another identity, a doc gone or one of another lineage means the db was
	// deleted (and maybe created again) under the cache. Starting over loads the checkpoint from
	// CouchDB, where a doc of the earlier db is no checkpoint: start drops a mirror rule's keys
	// of the earlier db and begins again.
	verifying := h.verify(ctx, cps.cp)
	// startOver takes the rule's checkpoint in db again from scratch (the one the run had was
	// another db's); stop says the run ends with r (the db is gone, or the start failed).
	startOver := func() (r ruleResult, stop bool) {
		cps.cp, since, cps.fresh, err = h.start(ctx, db, rule)
		switch {
		case errors.Is(err, couch.ErrNotFound):
			return h.dbGone(ctx, db, rule, log), true
		case err != nil:
			return ruleResult{err: err}, true
		}
		cps.stored, replay = since, replayOf(cps.cp)
		return ruleResult{}, false
	}
	streamChecked := false // the subject's stream, or the mirror bucket, was checked for gaps (checkStream, checkMirror)
	readFrom, pending := since, pages.page(since)
	for {
		cur, ok := h.current(rule.ID(), db)
		if !ok {
			log.Info("rule deleted, disabled or no longer matching the db: stopped")
			return finish(ruleResult{})
		}
		rule = cur
		if r, ok := h.outputReady(ctx, db, rule, log); !ok {
			return finish(r)
		}
		if pending == nil || readFrom != since { // no page read ahead, or one that starts elsewhere
			readFrom, pending = since, pages.page(since)
		}
		got := <-pending
		pending = nil // used up: a page read twice is read again (starting over may come back to the same seq)
		if verifying != nil {
			v := <-verifying
			verifying, cps.cp = nil, v.cp
			if errors.Is(v.err, checkpoint.ErrMoved) {
				log.Info("the cached checkpoint's db was deleted or recreated meanwhile: starting over")
				if r, stop := startOver(); stop {
					return finish(r)
				}
				verifying = h.verify(ctx, cps.cp)
				continue
			} else if v.err != nil {
				return finish(ruleResult{err: v.err})
			}
			replay = replayOf(cps.cp)
		}
		if !streamChecked {
			streamChecked = true
			from, err := h.checkOutput(ctx, db, rule, cps, since, log)
			if err != nil {
				return finish(ruleResult{err: fmt.Errorf("rule %s: %w", rule.ID(), err)})
			}
			if from != since { // our changes stream lost the latest changes after from: they are published again
				since = from
				continue
			}
		}
		page, err := got.page, got.err
		if errors.Is(err, couch.ErrNotFound) {
			return finish(h.dbGone(ctx, db, rule, log))
		}
		if err != nil {
			return finish(ruleResult{err: fmt.Errorf("rule %s: %w", rule.ID(), err)})
		}
		if len(page.Results) == 0 {
			return finish(h.caughtUp(ctx, cps, cmp.Or(page.LastSeq, since), log))
		}
		full := got.limit <= 0 || len(page.Results) >= got.limit
		if full && page.LastSeq != "" {
			readFrom, pending = page.LastSeq, pages.page(page.LastSeq)
		}
		b := h.processBatch(ctx, db, rule, since, replay, page.Results, log)
		next := pageEnd(since, page, b.done)
		if err := h.saveAfterPage(ctx, db, rule, cps, since, next, b); err != nil {
			return finish(ruleResult{err: err})
		}
		since = next
		if b.err != nil || b.retryIn > 0 {
			return finish(ruleResult{err: b.err, retryIn: b.retryIn, deferErr: b.deferErr})
		}
		if !full && next == page.LastSeq {
			// A short page is the end of the feed as it was read: no need to ask again for an
			// empty one. A change landing after it left a wakeup marker, which the worker's
			// lost-wakeup check takes after the ack to run the db again (natsjs.Jobs.Offer).
			return finish(h.caughtUp(ctx, cps, next, log))
		}
	}
}

// outputReady checks that rule can act in db: a subject rule's subject is captured by a stream
// (publisher.check), a mirror rule's bucket opens. ok false: the run ends with r.
func (h *handler) outputReady(ctx context.Context, db string, rule *rules.OnChange, log logrus.FieldLogger) (r ruleResult, ok bool) {
	if rule.Subject != "" {
		usable, err := h.publisher.check(ctx, db, rule, h.dead, log)
		if err != nil || !usable {
			return ruleResult{err: err, outcome: status.ResultFailed, why: errNoStream}, false
		}
	}
	if rule.Mirror != "" {
		if _, err := h.mirrors.bucket(ctx, rule.Mirror); err != nil {
			return ruleResult{err: fmt.Errorf("rule %s: %w", rule.ID(), err)}, false
		}
	}
	return ruleResult{}, true
}

// checkOutput is a job's first look, per rule, at what the rule keeps for readers, before it
// writes anything there: a mirror rule's bucket (checkMirror), a subject rule's stream
// (checkStream). It returns the seq the rule goes on from (since, unless our changes stream
// lost the latest changes the rule stored).
func (h *handler) checkOutput(ctx context.Context, db string, rule *rules.OnChange, cps *checkpointWriter, since string, log logrus.FieldLogger) (string, error) {
	switch {
	case rule.Mirror != "":
		return since, h.checkMirror(ctx, db, rule, cps, log)
	case rule.Subject != "":
		return h.checkStream(ctx, db, rule, cps, since, log)
	}
	return since, nil
}

// pageEnd returns where the checkpoint goes after a page of which the first done changes were
// acted on: the page's last_seq when all were, the last acted-on change's seq, or since.
func pageEnd(since string, page couch.ChangesPage, done int) string {
	switch {
	case done == len(page.Results) && page.LastSeq != "":
		return page.LastSeq
	case done > 0:
		return page.Results[done-1].Seq
	}
	return since
}

// saveAfterPage starts writing the checkpoint at next after a page (b) moved the rule from
// since. The requests still waiting for a retry go with it, so that the instance that runs the
// rule next goes on with their backoff: a rule that stopped at one saves even without progress.
// Nothing is written once the job's lease is lost.
func (h *handler) saveAfterPage(ctx context.Context, db string, rule *rules.OnChange, cps *checkpointWriter, since, next string, b batchResult) error {
	retries := h.book.of(rule.ID(), db)
	if next == since && (b.retryIn <= 0 || slices.EqualFunc(retries, cps.retries(), sameRetry)) {
		return nil
	}
	if !worker.Held(ctx) {
		return worker.ErrLeaseLost
	}
	return cps.save(ctx, next, h.streamPoint(ctx, db, rule), retries, max(b.done, 1))
}

// sameRetry reports whether a and b are the same deferred request at the same attempt.
func sameRetry(a, b checkpoint.Retry) bool {
	return a.Doc == b.Doc && a.Rev == b.Rev && a.Attempts == b.Attempts
}

// verified is the outcome of a checkpoint's verification: the checkpoint as Verify left it.
type verified struct {
	cp  checkpoint.OnChangePoint
	err error
}

// verify checks cp against its _local doc in the background (nil: cp was read from CouchDB and
// needs no check).
func (h *handler) verify(ctx context.Context, cp checkpoint.OnChangePoint) <-chan verified {
	if !cp.Cached() {
		return nil
	}
	out := make(chan verified, 1)
	go func() {
		err := h.store.Verify(ctx, &cp)
		out <- verified{cp, err}
	}()
	return out
}

// replayOf returns the replay that a run from cp is part of: the id of the replay that reset
// it, while that replay has not reached the end of the feed yet ("" otherwise).
func replayOf(cp checkpoint.OnChangePoint) string {
	if id, active := cp.Replay(); active {
		return id
	}
	return ""
}

// caughtUp is the result of a run that reached the end of the feed. A replay under way ends
// there: the checkpoint records it (once), so that later changes are first publications again
// and `producer replay` sees the replay done.
func (h *handler) caughtUp(ctx context.Context, cps *checkpointWriter, end string, log logrus.FieldLogger) ruleResult {
	if err := cps.wait(); err != nil {
		return ruleResult{err: err}
	}
	id, active := cps.cp.Replay()
	if !active {
		return ruleResult{caughtUp: true, end: end}
	}
	if !worker.Held(ctx) {
		return ruleResult{err: worker.ErrLeaseLost}
	}
	cps.cp.EndReplay()
	if err := cps.save(ctx, cps.stored, nil, nil, 0); err != nil {
		return ruleResult{err: err}
	}
	log.WithField("replay", id).Info("replay reached the end of the feed")
	return ruleResult{caughtUp: true, end: end}
}

// pageRead is the outcome of one _changes page read of at most limit changes.
type pageRead struct {
	page  couch.ChangesPage
	limit int
	err   error
}

// Pages of a job whose rules all publish or mirror (no webhook) grow after a full one, from
// SPIEGEL_CHANGES_BATCH up to maxGrownPage changes, as far as the docs read so far say that a
// page stays within half of pageBytes: such rules act on a page at once (a window, an atomic batch, a page of mirror
// writes), and a db's backlog read in pages of 100 cost CouchDB and the job a request and a
// round trip per 100 changes — 0.68× a loop reading pages of 1,000 in bench-streams, against
// 0.94× with pages of 1,000. Webhook rules keep SPIEGEL_CHANGES_BATCH: their pages are bound
// by the requests, and the checkpoint moves once per page.
const (
	maxGrownPage = 1000
	pageBytes    = 16 << 20
)

// pageSizer decides the size of a job's next _changes page. Safe for concurrent use (a page is
// read ahead while another is acted on).
type pageSizer struct {
	mu          sync.Mutex
	limit, most int
}

// pageSizer returns the sizer of a job with rules rs.
func (h *handler) pageSizer(rs []*rules.OnChange) *pageSizer {
	most := h.batchSize
	if h.batchSize < maxGrownPage && !slices.ContainsFunc(rs, func(r *rules.OnChange) bool { return r.Subject == "" && r.Mirror == "" }) {
		most = maxGrownPage
	}
	return &pageSizer{limit: h.batchSize, most: most}
}

// next returns the size of the next page to read.
func (s *pageSizer) next() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limit
}

// read notes a page read with limit: after a full page the next holds as many changes as docs of
// its size fit in half of pageBytes, up to most (the rest of the page budget is for the page
// read ahead), never fewer than limit.
func (s *pageSizer) read(limit int, page couch.ChangesPage) {
	if len(page.Results) < limit || s.most <= limit {
		return
	}
	bytes := 0
	for _, c := range page.Results {
		bytes += len(c.Doc)
	}
	next := s.most
	if bytes > 0 {
		next = min(s.most, max(limit, int(int64(len(page.Results))*(pageBytes/2)/int64(bytes))))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.limit = max(s.limit, next)
}

// checkpointWriter writes one rule's checkpoints in a db in the background, one at a time and in
// order.
type checkpointWriter struct {
	store       *checkpoint.OnChangeStore
	cp          checkpoint.OnChangePoint
	stored      string     // the last seq known stored
	fresh       bool       // the checkpoint began in this run: the rule had none in the db
	inFlight    chan error // the write under way (nil: none)
	inFlightSeq string
}

// save waits for the previous write (returning its error) and starts writing seq, after acted
// more changes, with stream as the checkpoint's stream point unless it is nil.
func (w *checkpointWriter) save(ctx context.Context, seq string, stream *checkpoint.StreamPoint, retries []checkpoint.Retry, acted int) error {
	if err := w.wait(); err != nil {
		return err
	}
	if stream != nil {
		w.cp.Stream = *stream
	}
	w.cp.Retries = retries
	w.cp.Acted(acted)
	done := make(chan error, 1)
	w.inFlight, w.inFlightSeq = done, seq
	save := w.store.Save
	if len(retries) > 0 {
		// Deferred requests go into the _local doc at once too: a run that reads the doc rather
		// than the cache still goes on with their backoff. Deferrals are rare.
		save = w.store.SaveNow
	}
	go func() { done <- save(ctx, &w.cp, seq) }()
	return nil
}

// retries returns the deferred requests of the checkpoint as last saved (or loaded). Only save
// changes them, after the write before it is done; a write under way only reads them.
func (w *checkpointWriter) retries() []checkpoint.Retry { return w.cp.Retries }

// wait waits for the write under way, if any.
func (w *checkpointWriter) wait() error {
	if w.inFlight == nil {
		return nil
	}
	err := <-w.inFlight
	w.inFlight = nil
	if err == nil {
		w.stored = w.inFlightSeq
	}
	return err
}

// start returns rule's checkpoint in db and the seq the rule starts after: the checkpoint;
// without one, per the rule's since: the beginning, or the db's current end, saved at once so
// that "now" keeps meaning the moment the rule first saw the db. Either way a rule new to db
// stores its checkpoint before it reads anything of db. fresh says there was none. A missing
// db is an error matching couch.ErrNotFound.
func (h *handler) start(ctx context.Context, db string, rule *rules.OnChange) (cp checkpoint.OnChangePoint, since string, fresh bool, err error) {
	cp, err = h.store.Load(ctx, rule.ID(), db)
	if err == nil && !cp.Found {
		// A mirror rule without a checkpoint in db rebuilds the db's mirror from scratch: what the
		// bucket holds of db is from before (an earlier db of that name) and goes first.
		if err := h.dropMirror(ctx, db, rule, h.log.WithFields(logrus.Fields{"db": db, "rule": rule.ID()})); err != nil {
			return cp, "", false, err
		}
		if rule.Mirror != "" {
			mirrorPointOf(ctx, rule.Mirror).begin() // the job knows every key of db it writes from now on
		}
	}
	if err != nil || cp.Found {
		return cp, cp.LastSeq, false, err
	}
	if rule.Since != rules.SinceNow {
		// The rule's first _local doc in db is written before anything of db is read (see
		// checkpoint.OnChangeStore.Begin): otherwise a db deleted and created again while the run
		// acts on its first page would get the old db's seq as its checkpoint, and its first
		// changes would be skipped (seen in a chaos run).
		if pt := mirrorPointOf(ctx, rule.Mirror).point(); rule.Mirror != "" && pt != nil {
			cp.Stream = *pt // the drop of the db's earlier keys, which the bucket may lose
		}
		if err := h.store.Begin(ctx, &cp); err != nil {
			return cp, "", false, err
		}
		return cp, "", true, nil
	}
	page, err := h.couch.Changes(ctx, db, couch.ChangesOptions{Since: couch.SinceNow, Limit: 1})
	if err != nil {
		return cp, "", false, err
	}
	if err := h.store.Save(ctx, &cp, page.LastSeq); err != nil {
		return cp, "", false, err
	}
	return cp, cp.LastSeq, true, nil
}

// dropMirror deletes db's keys from a mirror rule's bucket (nothing for other rules).
func (h *handler) dropMirror(ctx context.Context, db string, rule *rules.OnChange, log logrus.FieldLogger) error {
	if rule.Mirror == "" {
		return nil
	}
	n, err := h.mirrors.dropDB(ctx, rule.Mirror, db)
	if err != nil {
		return fmt.Errorf("rule %s: %w", rule.ID(), err)
	}
	if n > 0 {
		log.WithFields(logrus.Fields{"bucket": rule.Mirror, "keys": n}).Info("mirror: the keys of an earlier or deleted db removed")
	}
	return nil
}

// dbGone is the result of a rule's run in a db that does not exist: its cached checkpoint, its
// mirror keys and its mirror fence are removed, and the job is dropped (a db created again gets
// a job of its own).
func (h *handler) dbGone(ctx context.Context, db string, rule *rules.OnChange, log logrus.FieldLogger) ruleResult {
	h.store.Forget(ctx, rule.ID(), db)
	if err := h.dropMirror(ctx, db, rule, log); err != nil {
		return ruleResult{err: err}
	}
	h.forgetFence(ctx, db, rule, log)
	log.Warn("db does not exist: job dropped (it is enqueued again when the db is recreated)")
	return ruleResult{outcome: status.ResultMissingSource}
}

// forgetFence removes a missing db's fence from a mirror rule's bucket once its keys are
// dropped, so that a deleted db leaves nothing in the bucket but its keys' delete markers. A
// failure is only logged: one small message stays in the bucket.
func (h *handler) forgetFence(ctx context.Context, db string, rule *rules.OnChange, log logrus.FieldLogger) {
	if rule.Mirror == "" {
		return
	}
	if err := h.mirrors.forgetDB(ctx, rule.Mirror, db, rule.Timeout); err != nil {
		log.WithError(err).Warn("mirror: the fence of a db that does not exist could not be removed")
	}
}

// current returns the live version of rule id if it is still enabled and matches db.
func (h *handler) current(id, db string) (*rules.OnChange, bool) {
	r, ok := h.rules.Rule(id)
	if !ok {
		return nil, false
	}
	oc, ok := r.(*rules.OnChange)
	return oc, ok && oc.Enabled() && oc.MatchesDB(db)
}
