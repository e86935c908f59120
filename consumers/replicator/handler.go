package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// dbNotFoundAttempts is the delivery from which a db_not_found answer is given up as permanent.
// Before it the job is retried with the runner's backoff (about 10 minutes with the defaults),
// because CouchDB's replicator also says db_not_found when an endpoint answered an unexpected
// status, e.g. a 503 of a proxy in front of the target.
const dbNotFoundAttempts = 10

// engine runs one one-shot replication. body is the _replicate body (with credentials);
// secrets are the passwords it holds, which no returned error may contain.
type engine interface {
	Replicate(ctx context.Context, body map[string]any, secrets []string) (result, error)
}

// dbInfoReader reads a db's info (*couch.Client).
type dbInfoReader interface {
	DBInfo(ctx context.Context, db string) (couch.DBInfo, error)
}

// ruleSource lists the enabled replicator rules matching a db, sorted by id (*rules.Set).
type ruleSource interface {
	Replicators(db string) []*rules.Replicator
}

// deadLetterPublisher stores dead-letter records (*worker.DeadLetters).
type deadLetterPublisher interface {
	Publish(ctx context.Context, rec worker.DeadLetter) error
}

// replicator is the handler of the replicate group (SPEC §5.2).
type replicator struct {
	dbs           dbInfoReader
	rules         ruleSource
	deadLetters   deadLetterPublisher
	metrics       *metrics.Consumer // may be nil
	status        *status.Recorder  // may be nil
	log           logrus.FieldLogger
	base          *url.URL // the watched server with the service's credentials: never log it
	passwords     injector
	engines       map[string]engine // by rule engine name; a missing engine fails its rules
	defaultEngine string            // engine of rules that name none
	timeout       time.Duration     // bound of one replication of one rule
}

// handle replicates job.DB with every enabled rule that matches it. Contract:
//
//   - dirty_after_milliseconds: on the first delivery, if a matching rule has a delay, the job
//     is postponed by the longest such delay (worker.RetryAfter), so a burst of writes landing
//     meanwhile is absorbed by the one pending job. All the db's rules then run together.
//   - A change that lands while the job runs is not looked for here: it left a wakeup marker,
//     and the worker's lost-wakeup check, after the ack, runs the db again (natsjs.Jobs.Offer).
//   - A missing source db is not an error: one warning, the job is acked (no retry loop). The
//     db's next creation and write enqueues it again. (The check also keeps PouchDB Server from
//     silently creating the missing source on _replicate.)
//   - Rules run one after the other, each bounded by the replication timeout, and each failure
//     is isolated: every matching rule runs whatever happened to the others.
//   - A rule that fails permanently (credentials refused, a request the server rejects, an
//     endpoint that cannot be built, an unavailable engine) gets a dead-letter record naming it
//     and does not fail the job: it cannot succeed by retrying, and it must not hold back the
//     other rules. It runs again on the db's next change.
//   - If any rule failed transiently (network, 5xx, timeout), the whole job returns an error
//     and is retried with backoff, including the rules that succeeded. That is harmless and
//     cheap: replications are idempotent, and a one-shot replication that finds nothing new
//     after its checkpoint is a no-op. Tracking per-rule progress would need state that the work
//     queue deliberately does not hold.
//   - If the dead letter of a permanent failure cannot be stored, that rule counts as failed
//     transiently, so that no failure is given up silently.
func (h *replicator) handle(ctx context.Context, job *worker.Job) error {
	rs := h.rules.Replicators(job.DB)
	log := h.log.WithFields(logrus.Fields{"db": job.DB, "attempt": job.Attempt})
	if len(rs) == 0 {
		log.Debug("no replicator rule matches the db any more: nothing to do")
		return nil
	}
	if d := maxDirtyAfter(rs); d > 0 {
		if job.Attempt == 1 {
			return worker.RetryAfter(d, nil)
		}
		job.Postponed = 1 // the first delivery was the delay, not a failure
	}
	var sourceSeq string // the source's update_seq read before a couchdb-engine run
	if h.needsSourceCheck(rs) {
		// The couchdb engine asks the server's _replicate, which on PouchDB Server silently
		// creates a missing source: check first. The native engine tells a missing source
		// itself, without this request. The update_seq read here is what a successful
		// _replicate vouches for (the run replicates at least up to it).
		info, err := h.dbs.DBInfo(ctx, job.DB)
		if errors.Is(err, couch.ErrNotFound) {
			h.missingSource(rs, log)
			return nil
		}
		if err != nil {
			return err // transient: the watched server did not answer
		}
		sourceSeq = info.UpdateSeq
	}

	var failures []error
	for _, r := range rs {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := h.runRule(ctx, job, r, sourceSeq, log.WithField("rule", r.ID())); err != nil {
			failures = append(failures, err)
		}
	}
	if len(failures) > 0 {
		return fmt.Errorf("%d of %d replications of db %s failed: %w", len(failures), len(rs), job.DB, errors.Join(failures...))
	}
	return nil
}

// needsSourceCheck reports whether a rule of rs runs on an engine other than native.
func (h *replicator) needsSourceCheck(rs []*rules.Replicator) bool {
	for _, r := range rs {
		if h.engineName(r) != rules.EngineNative {
			return true
		}
	}
	return false
}

// missingSource records that the job's source db does not exist: one warning, no retry. The
// db's next creation and write enqueues it again.
func (h *replicator) missingSource(rs []*rules.Replicator, log logrus.FieldLogger) {
	log.Warn("source db does not exist: nothing to replicate; it is replicated again once it is recreated and written")
	for _, r := range rs {
		h.metrics.Replication(h.engineName(r), "missing_source", 0, 0)
		h.status.RuleRun(r.ID(), status.ResultMissingSource, nil)
	}
}

// runRule runs one rule for job.DB. It returns an error only for a transient failure; a
// permanent one is logged and dead-lettered here. A success vouches for the position of the
// source it replicated up to (reconcile.Vouch: the native engine's end of the feed, or
// sourceSeq, read before a _replicate); a permanent failure settles the db
// (reconcile.Settled), so that the sweep does not run it again only to fail the same way.
func (h *replicator) runRule(ctx context.Context, job *worker.Job, r *rules.Replicator, sourceSeq string, log logrus.FieldLogger) error {
	engineName := h.engineName(r)
	log = log.WithField("engine", engineName)
	eng, ok := h.engines[engineName]
	if !ok {
		return h.giveUp(ctx, job, r, engineName, request{}, fmt.Errorf("engine %s is not available in this process", engineName), log)
	}
	req, err := buildRequest(r, job.DB, h.base, h.passwords)
	if err != nil {
		return h.giveUp(ctx, job, r, engineName, req, err, log)
	}
	log = log.WithFields(logrus.Fields{"source": req.Source, "target": req.Target})
	log.Debug("replication starting")

	rctx, cancel := context.WithTimeout(withRule(ctx, r.ID()), h.timeout)
	started := time.Now()
	res, err := eng.Replicate(rctx, req.Body, req.Secrets)
	took := time.Since(started)
	timedOut := errors.Is(rctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
	cancel()

	if err == nil {
		if engineName == rules.EngineNative {
			reconcile.Vouch(ctx, res.FeedEnd)
		} else {
			reconcile.Vouch(ctx, sourceSeq)
		}
		h.metrics.Replication(engineName, "ok", res.DocsWritten, took)
		h.status.RuleRun(r.ID(), status.ResultOK, nil)
		l := log.WithFields(logrus.Fields{"docs_written": res.DocsWritten, "no_changes": res.NoChanges, "duration_ms": took.Milliseconds()})
		if res.DocWriteFailures > 0 {
			l.WithField("doc_write_failures", res.DocWriteFailures).Warn("replicated, but the target refused some docs")
		} else {
			l.Info("replicated")
		}
		return nil
	}
	if errors.Is(err, errSourceMissing) {
		h.missingSource([]*rules.Replicator{r}, log)
		return nil
	}
	h.metrics.Replication(engineName, "error", 0, took)
	if timedOut {
		err = fmt.Errorf("rule %s: replication %s → %s timed out after %s: %w", r.ID(), req.Source, req.Target, h.timeout, err)
		h.status.RuleRun(r.ID(), status.ResultError, err)
		return err
	}
	switch classify(err) {
	case permanent:
		return h.giveUp(ctx, job, r, engineName, req, err, log)
	case dbNotFound:
		if job.Tries() >= dbNotFoundAttempts {
			err = fmt.Errorf("%w (given up after %d attempts: create the db, or set create_target for a missing target)", err, job.Tries())
			return h.giveUp(ctx, job, r, engineName, req, err, log)
		}
	}
	err = fmt.Errorf("rule %s: replication %s → %s: %w", r.ID(), req.Source, req.Target, err)
	h.status.RuleRun(r.ID(), status.ResultError, err)
	return err
}

// giveUp records a permanent failure of rule r: a dead letter naming the rule, and one error
// log line. It returns nil when the record is stored, else a transient error so the job is
// retried rather than the failure lost.
func (h *replicator) giveUp(ctx context.Context, job *worker.Job, r *rules.Replicator, engineName string, req request, cause error, log logrus.FieldLogger) error {
	rec := worker.DeadLetter{
		Group: events.GroupReplicate, DB: job.DB, Rule: r.ID(), Seq: job.Seq, Error: cause.Error(), Attempts: job.Tries(),
		Details: map[string]any{"engine": engineName},
	}
	if req.Source != "" {
		rec.Details["source"], rec.Details["target"] = req.Source, req.Target
	}
	var re *replicateError
	if errors.As(cause, &re) {
		rec.Status = re.Status
		if re.ErrorName != "" {
			rec.Details["error_name"] = re.ErrorName
		}
	}
	if status := authStatus(cause); status != 0 {
		// The record says what it is: refused credentials, whatever status carried them.
		if rec.Status != status {
			rec.Details["server_status"] = rec.Status
		}
		rec.Status = status
		rec.Details["cause"] = "credentials refused"
		rec.Error = "credentials of the source or target refused: " + rec.Error
	}
	if err := h.deadLetters.Publish(ctx, rec); err != nil {
		err = fmt.Errorf("rule %s failed permanently (%v), and its dead letter could not be stored: %w", r.ID(), cause, err)
		h.status.RuleRun(r.ID(), status.ResultError, err)
		return err
	}
	h.status.RuleRun(r.ID(), status.ResultFailed, errors.New(rec.Error))
	h.metrics.DeadLetter(events.GroupReplicate)
	reconcile.Settled(ctx)
	log.WithError(cause).Error("replication failed permanently: dead letter recorded; it runs again on the db's next change")
	return nil
}

func (h *replicator) engineName(r *rules.Replicator) string {
	if r.Engine != "" {
		return r.Engine
	}
	return h.defaultEngine
}

// maxDirtyAfter returns the longest dirty_after_milliseconds of rs.
func maxDirtyAfter(rs []*rules.Replicator) time.Duration {
	var d time.Duration
	for _, r := range rs {
		d = max(d, r.DirtyAfter)
	}
	return d
}
