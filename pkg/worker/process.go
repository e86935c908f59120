package worker

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

const (
	// settleTimeout bounds one ack, dead-letter publish or republish.
	settleTimeout = 10 * time.Second
)

// process runs one job, delivered in answer to a pull request sent at pulled, and settles its
// message. handlerCtx ends when the grace period of a shutdown is over. What it returns, when not
// nil, is the rest of the job's lost-wakeup check (a pause, then enqueueing the job again: see
// checkWakeup), which the caller runs after it freed the job's slot, so that waits do not hold
// slots that other jobs could use.
func (r *Runner) process(handlerCtx context.Context, msg jetstream.Msg, pulled time.Time) (then func()) {
	attempt, queued := 1, time.Duration(0)
	var enqueuedAt time.Time
	if md, err := msg.Metadata(); err == nil {
		if md.NumDelivered > 0 {
			attempt = int(md.NumDelivered)
		}
		queued = time.Since(md.Timestamp)
	}
	group, db, err := r.subjects.ParseWork(msg.Subject())
	if err == nil && group != r.cfg.Group {
		err = fmt.Errorf("parse work subject %q: group %s, want %s", msg.Subject(), group, r.cfg.Group)
	}
	if err != nil {
		r.rejectSubject(handlerCtx, msg, attempt, pulled, err)
		return nil
	}
	job := &Job{Group: group, DB: db, Attempt: attempt, wakeupSeq: natsjs.WakeupSeq(msg.Headers())}
	log := r.log.WithFields(logrus.Fields{"db": db, "attempt": attempt})
	if payload, err := events.UnmarshalJob(msg.Data()); err != nil {
		log.WithError(err).Warn("bad job payload: running the job from its subject alone")
	} else {
		job.Reason, job.Seq, job.Rules = payload.Reason, payload.Seq, payload.Rules
		enqueuedAt = payload.At
	}

	c, sent, err := r.claimLease(handlerCtx, group, db)
	if err != nil {
		delay := r.cfg.AckWait / 4
		if errors.Is(err, errClaimed) {
			log.Debug("the db's job runs in another instance: this delivery is given back")
		} else {
			log.WithError(err).Warn("take the job's lease failed: this delivery is given back")
		}
		r.nak(msg, delay, log)
		r.observe(ResultRetry, 0)
		return nil
	}
	job.lease = newLease(r.cfg.AckWait, sent, r.now)
	ctx, cancel := context.WithCancelCause(withJob(handlerCtx, job))
	defer cancel(nil)
	job.lease.whenLost(func() {
		log.WithError(ErrLeaseLost).Warn("job lease ran out before a renewal was confirmed: stopped, left unsettled; another instance runs it")
		cancel(ErrLeaseLost)
	})
	stopKeepAlive := r.keepAlive(ctx, msg, job.lease, c, log)
	if attempt > 1 || queued >= r.cfg.queuedLong {
		r.readWakeupAtStart(ctx, job, log)
	}
	started := time.Now()
	herr := r.runHandler(ctx, job)
	took := time.Since(started)

	result := r.settle(handlerCtx, msg, job, herr, stopKeepAlive, log)
	r.observe(result, took)
	// Where a job's time went, for a db whose change arrived late: who enqueued it (a feed
	// event's type, or sweep, wakeup, rule, resync) and when (the producer's clock), and how
	// long it waited in the queue.
	log.WithFields(logrus.Fields{"reason": job.Reason, "enqueued_at": enqueuedAt, "result": result,
		"queued_ms": queued.Milliseconds(), "took_ms": took.Milliseconds()}).Debug("job settled")
	if result == ResultOK || result == ResultFailed {
		return r.checkWakeup(handlerCtx, job, log)
	}
	return nil
}

// runHandler calls the handler, turning a panic into a transient error.
func (r *Runner) runHandler(ctx context.Context, job *Job) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("handler panicked: %v\n%s", p, debug.Stack())
		}
	}()
	return r.handler(ctx, job)
}

// ackProgress is the body of an InProgress acknowledgement.
var ackProgress = []byte("+WPI")

// keepAlive renews l until the returned stop is called, ctx ends or the lease runs out; stop
// returns once no renewal can be sent any more. A renewal is an InProgress sent as a request:
// the consumer's answer confirms that the server received it (see lease). One is sent when a
// third of AckWait has passed since the lease was last renewed, and again every AckWait/20 while
// none is confirmed; each waits for its answer for AckWait/4 at most (an answer lost in a
// reconnect must not use up the lease) and never past the lease's end. keepAlive looks at
// the lease the moment it is due to run out, so that its whenLost callback runs then at the
// latest.
func (r *Runner) keepAlive(ctx context.Context, msg jetstream.Msg, l *lease, c *claim, log logrus.FieldLogger) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		every := max(r.cfg.AckWait/3, time.Millisecond)
		retry := max(r.cfg.AckWait/20, time.Millisecond)
		patience := max(r.cfg.AckWait/4, time.Millisecond)
		from, until := l.renewedAt()
		next := from.Add(every)
		for {
			if !l.held() {
				return
			}
			now := r.now()
			if wait := min(next.Sub(now), until.Sub(now)); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-ctx.Done():
					t.Stop()
					return
				case <-t.C:
				}
				continue
			}
			sent := r.now()
			rctx, rcancel := context.WithTimeout(ctx, min(until.Sub(sent), patience))
			err := r.renew(rctx, msg, c)
			rcancel()
			switch {
			case ctx.Err() != nil:
				return
			case errors.Is(err, errClaimed):
				log.Warn("the job's lease was taken by another instance: stopped")
				l.lose()
				return
			case err == nil && l.renewed(sent):
				from, until = l.renewedAt()
				next = from.Add(every)
			default:
				if err != nil {
					log.WithError(err).Debug("renew job lease failed: retrying while the lease lasts")
				}
				next = r.now().Add(retry)
			}
		}
	})
	return func() {
		cancel()
		wg.Wait()
		if c == nil {
			return
		}
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		defer rcancel()
		if err := c.release(rctx); err != nil {
			log.WithError(err).Debug("release the job's lease failed: it expires after AckWait")
		}
	}
}

// renew renews a running job's lease: the claim's next lease message, confirmed by the stream
// (c nil: an InProgress sent as a request, which the consumer confirms). With a claim an
// InProgress is sent as well, without waiting, so that JetStream does not deliver the job again
// while it runs; the lease does not rest on it.
func (r *Runner) renew(ctx context.Context, msg jetstream.Msg, c *claim) error {
	if c == nil {
		_, err := r.nc.RequestWithContext(ctx, msg.Reply(), ackProgress)
		return err
	}
	_ = msg.InProgress()
	return c.write(ctx)
}

// claimLease takes the lease of (g, db)'s job for this delivery (see claim) and returns it with the
// moment its write was sent, from which the lease counts. errClaimed: another instance holds it.
func (r *Runner) claimLease(ctx context.Context, g events.Group, db string) (*claim, time.Time, error) {
	c, err := newClaim(r.js, r.subjects.LeaseStream(), r.subjects.Lease(g, db), r.cfg.AckWait)
	if err != nil {
		return nil, time.Time{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, max(r.cfg.AckWait/4, time.Second))
	defer cancel()
	sent := r.now()
	return c, sent, c.write(ctx)
}

// settle acks, naks or terminates msg from the handler's result and returns the result for the
// Observer. stopKeepAlive is called before the message is settled.
func (r *Runner) settle(handlerCtx context.Context, msg jetstream.Msg, job *Job, herr error, stopKeepAlive func(), log logrus.FieldLogger) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(handlerCtx), settleTimeout)
	defer cancel()

	if !job.Held() {
		// Another consumer may be running the job: settling this delivery could end its run.
		stopKeepAlive()
		log.WithError(ErrLeaseLost).Warn("job not settled: its lease ran out")
		return ResultRetry
	}
	if handlerCtx.Err() != nil {
		// The grace period is over: whatever the handler returned, it may have been cut short.
		stopKeepAlive()
		if err := msg.Nak(); err != nil {
			log.WithError(err).Warn("nak interrupted job failed: it runs again after AckWait")
		} else {
			log.Info("job interrupted by shutdown: nak'ed for a redelivery")
		}
		return ResultRetry
	}

	if herr == nil {
		stopKeepAlive()
		if err := msg.DoubleAck(ctx); err != nil {
			log.WithError(err).Error("ack job failed: it may run again after AckWait")
		}
		return ResultOK
	}

	if IsPermanent(herr) {
		rec := DeadLetter{Group: job.Group, DB: job.DB, Seq: job.Seq, Error: herr.Error(), Attempts: job.Tries()}
		if err := r.deadLetters.Publish(ctx, rec); err != nil {
			// Terminating without a record would give the job up silently: run it again later.
			delay := r.cfg.Retry.Delay(job.Tries())
			stopKeepAlive()
			r.nak(msg, delay, log)
			log.WithError(err).WithField("job_error", herr.Error()).WithField("delay", delay.String()).
				Error("job failed permanently but its dead letter could not be stored: retrying the job")
			return ResultRetry
		}
		stopKeepAlive()
		if err := msg.Term(); err != nil {
			log.WithError(err).Error("terminate failed job failed: it runs again after AckWait")
		}
		log.WithError(herr).Error("job failed permanently: dead letter recorded")
		return ResultFailed
	}

	if ra, ok := asRetryAfter(herr); ok {
		stopKeepAlive()
		r.nak(msg, ra.delay, log)
		if ra.err == nil {
			log.WithField("delay", ra.delay.String()).Debug("job postponed")
			return ResultDelayed
		}
		log.WithError(ra.err).WithField("delay", ra.delay.String()).Warn("job failed, retrying")
		return ResultRetry
	}

	delay := r.cfg.Retry.Delay(job.Tries())
	stopKeepAlive()
	r.nak(msg, delay, log)
	log.WithError(herr).WithField("delay", delay.String()).Warn("job failed, retrying")
	return ResultRetry
}

func (r *Runner) nak(msg jetstream.Msg, delay time.Duration, log logrus.FieldLogger) {
	if err := msg.NakWithDelay(delay); err != nil {
		log.WithError(err).Warn("nak job failed: it runs again after AckWait")
	}
}

// rejectSubject gives up a message whose subject names no db of this group: dead letter, Term.
func (r *Runner) rejectSubject(handlerCtx context.Context, msg jetstream.Msg, attempt int, pulled time.Time, perr error) {
	log := r.log.WithFields(logrus.Fields{"subject": msg.Subject(), "attempt": attempt})
	ctx, cancel := context.WithTimeout(context.WithoutCancel(handlerCtx), settleTimeout)
	defer cancel()
	stopKeepAlive := r.keepAlive(ctx, msg, newLease(r.cfg.AckWait, pulled, r.now), nil, log)
	rec := DeadLetter{Group: r.cfg.Group, DB: msg.Subject(), Error: perr.Error(), Attempts: attempt,
		Details: map[string]any{"subject": msg.Subject()}}
	err := r.deadLetters.Publish(ctx, rec)
	stopKeepAlive()
	if err != nil {
		r.nak(msg, r.cfg.Retry.Delay(attempt), log)
		log.WithError(err).Error("bad work subject, and its dead letter could not be stored: retrying")
		r.observe(ResultRetry, 0)
		return
	}
	if err := msg.Term(); err != nil {
		log.WithError(err).Error("terminate job with a bad subject failed: it runs again after AckWait")
	}
	log.WithError(perr).Error("bad work subject: dead letter recorded")
	r.observe(ResultFailed, 0)
}

func (r *Runner) observe(result string, d time.Duration) {
	if r.cfg.Observer != nil {
		r.cfg.Observer.JobDone(r.cfg.Group, result, d)
	}
}

// wakeupFailurePause paces the jobs enqueued again because their lost-wakeup check failed, by
// how long the checks have been failing (backoff.Streak): the jobs in flight when the wakeup
// stream's leader moves all fail their check at once, and wait as one would.
var wakeupFailurePause = backoff.Policy{Initial: 500 * time.Millisecond, Max: 30 * time.Second, Jitter: 0.2}

// checkWakeup runs the lost-wakeup check of a settled job (acked, or terminated with a dead
// letter): it reads the db's wakeup marker (one API request) and
//
//   - finds none: done;
//   - finds the marker this delivery was offered for: the run covered it; it is deleted by its
//     sequence (a newer marker stays);
//   - finds another: a change may have come that the run missed, so the job is offered again
//     for that marker, which stays until a run covers it (natsjs "The lost-wakeup rule");
//   - cannot read it: the job is offered again to be safe, after a pause that grows while checks
//     keep failing (the wakeup stream missing, NATS down): a run must not follow a run without end.
//
// Enqueueing the job again, and the pause before it, are returned as then, for the caller to
// run once the job's slot is free: a burst of failed checks (a NATS leader election) must not
// leave the worker without slots for the pause's length.
//
// A marker is never deleted before a job that covers it is stored, so a process that dies here
// loses nothing: the change stays unprocessed, so the db's completion record stays behind its
// update_seq, and the producer's reconciliation sweep enqueues the db.
func (r *Runner) checkWakeup(handlerCtx context.Context, job *Job, log logrus.FieldLogger) (then func()) {
	ctx, cancel := context.WithTimeout(handlerCtx, settleTimeout)
	m, err := r.jobs.ReadWakeup(ctx, job.Group, job.DB)
	cancel()
	if err != nil {
		delay := r.wakeupStreak.Failed(r.cfg.wakeupPause, time.Now())
		log.WithError(err).WithField("delay", delay.String()).Warn("lost-wakeup check failed: enqueueing the job again to be safe")
		return func() {
			if backoff.Sleep(handlerCtx, delay) != nil {
				return
			}
			r.offerWakeup(handlerCtx, job, natsjs.Wakeup{Rules: job.Rules}, log)
		}
	}
	r.wakeupStreak.Succeeded()
	switch {
	case m.Seq == 0:
	case m.Seq == job.wakeupSeq:
		ctx, cancel := context.WithTimeout(handlerCtx, settleTimeout)
		defer cancel()
		if err := r.jobs.ClearWakeup(ctx, job.Group, job.DB, m.Seq); err != nil {
			log.WithError(err).Debug("clear wakeup marker failed: the db's next job runs once more than needed")
		}
	default:
		return func() { r.offerWakeup(handlerCtx, job, m, log) }
	}
	return nil
}

// queuedMarkerRead is how long a first delivery must have waited in the queue for its run to read
// the db's wakeup marker before it starts (readWakeupAtStart). A job taken at once skips the read
// (the job path stays at one API request beyond fetch and ack); behind a backlog — an initial
// sync of 10,000 dbs keeps jobs queued for minutes, while the producer's feed and its sweep offer
// most dbs a second time — the read saves the run per db that the marker would have cost.
const queuedMarkerRead = time.Second

// readWakeupAtStart reads the db's wakeup marker before a job runs that waited: redelivered
// (postponed by RetryAfter, e.g. a rule's dirty_after delay, or retried after a failure), or
// delivered first after queuedMarkerRead in the queue. Changes that came while it waited are
// read by this run, so their marker, read now, counts as covered and costs no run more after
// this one; the run then needs the rule set the marker's job named (Job.Rules). A first delivery
// taken at once skips it; a marker set in its short wait costs one more run. A failure is
// harmless: the check after the run then offers the job again for the marker.
func (r *Runner) readWakeupAtStart(ctx context.Context, job *Job, log logrus.FieldLogger) {
	rctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	m, err := r.jobs.ReadWakeup(rctx, job.Group, job.DB)
	if err != nil {
		log.WithError(err).Debug("read wakeup marker before the run failed: a marker makes one run more")
		return
	}
	if m.Seq != 0 {
		job.wakeupSeq = m.Seq
		if m.Rules != "" {
			job.Rules = m.Rules
		}
	}
}

// offerWakeup enqueues the job again for the wakeup marker m, retrying until it is stored (or
// refused: a job for the db is pending or running, and reads the marker after its run) or the
// handlers' context ends (the end of a shutdown's grace period; the reconciliation sweep finds
// the db behind its record).
func (r *Runner) offerWakeup(handlerCtx context.Context, job *Job, m natsjs.Wakeup, log logrus.FieldLogger) {
	retry := backoff.Policy{Initial: 200 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2, Jitter: 0.2}
	for attempt := 1; ; attempt++ {
		ctx, cancel := context.WithTimeout(handlerCtx, settleTimeout)
		_, err := r.jobs.OfferWakeup(ctx, job.Group, job.DB, m)
		cancel()
		if err == nil {
			log.WithField("marker", m.Seq).Debug("db changed while its job ran: job enqueued again")
			return
		}
		if backoff.Sleep(handlerCtx, retry.Delay(attempt)) != nil {
			log.WithError(err).Warn("enqueue job again after a lost wakeup failed until shutdown: the reconciliation sweep enqueues it")
			return
		}
		log.WithError(err).WithField("attempt", attempt).Warn("enqueue job again after a lost wakeup failed: retrying")
	}
}
