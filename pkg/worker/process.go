package worker

import (
	"context"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
)

const (
	// settleTimeout bounds one ack, dead-letter publish or republish.
	settleTimeout = 10 * time.Second
)

// process runs one job and settles its message. handlerCtx ends when the grace period of a
// shutdown is over.
func (r *Runner) process(handlerCtx context.Context, msg jetstream.Msg) {
	attempt := 1
	if md, err := msg.Metadata(); err == nil && md.NumDelivered > 0 {
		attempt = int(md.NumDelivered)
	}
	group, db, err := r.subjects.ParseWork(msg.Subject())
	if err == nil && group != r.cfg.Group {
		err = fmt.Errorf("parse work subject %q: group %s, want %s", msg.Subject(), group, r.cfg.Group)
	}
	if err != nil {
		r.rejectSubject(handlerCtx, msg, attempt, err)
		return
	}
	job := &Job{Group: group, DB: db, Attempt: attempt}
	log := r.log.WithFields(logrus.Fields{"db": db, "attempt": attempt})
	if payload, err := events.UnmarshalJob(msg.Data()); err != nil {
		log.WithError(err).Warn("bad job payload: running the job from its subject alone")
	} else {
		job.Reason, job.Seq = payload.Reason, payload.Seq
	}

	ctx, cancel := context.WithCancel(withJob(handlerCtx, job))
	defer cancel()
	stopKeepAlive := r.keepAlive(ctx, msg, log)
	r.clearWakeup(ctx, job, log)
	started := time.Now()
	herr := r.runHandler(ctx, job)
	took := time.Since(started)

	result := r.settle(handlerCtx, msg, job, herr, stopKeepAlive, log)
	r.observe(result, took)
	if result == ResultOK {
		r.takeWakeup(handlerCtx, job, log)
	}
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

// keepAlive sends InProgress at once (the job may have waited in a client buffer) and then every
// AckWait/3 until the returned stop is called or ctx ends; stop returns once no InProgress can be
// sent any more.
func (r *Runner) keepAlive(ctx context.Context, msg jetstream.Msg, log logrus.FieldLogger) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(max(r.cfg.AckWait/3, time.Millisecond))
		defer tick.Stop()
		for {
			if err := msg.InProgress(); err != nil {
				log.WithError(err).Debug("keep job alive failed")
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return func() { cancel(); wg.Wait() }
}

// settle acks, naks or terminates msg from the handler's result and returns the result for the
// Observer. stopKeepAlive is called before the message is settled.
func (r *Runner) settle(handlerCtx context.Context, msg jetstream.Msg, job *Job, herr error, stopKeepAlive func(), log logrus.FieldLogger) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(handlerCtx), settleTimeout)
	defer cancel()

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
func (r *Runner) rejectSubject(handlerCtx context.Context, msg jetstream.Msg, attempt int, perr error) {
	log := r.log.WithFields(logrus.Fields{"subject": msg.Subject(), "attempt": attempt})
	ctx, cancel := context.WithTimeout(context.WithoutCancel(handlerCtx), settleTimeout)
	defer cancel()
	stopKeepAlive := r.keepAlive(ctx, msg, log)
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

// wakeupFailurePause paces the jobs enqueued again because their lost-wakeup check failed.
var wakeupFailurePause = backoff.Policy{Initial: 500 * time.Millisecond, Max: 30 * time.Second, Multiplier: 2, Jitter: 0.2}

// clearWakeup removes the db's wakeup marker before the handler runs: the run reads every
// change the marker stood for (natsjs.Jobs.Offer).
func (r *Runner) clearWakeup(ctx context.Context, job *Job, log logrus.FieldLogger) {
	cctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	if err := r.jobs.ClearWakeup(cctx, job.Group, job.DB); err != nil {
		log.WithError(err).Debug("clear wakeup marker failed: the job may be offered once more than needed")
	}
}

// takeWakeup runs the lost-wakeup check of an acked job (SPEC §3): a wakeup marker set while the
// job ran means a change came that the run may have missed, so the job is offered again. When
// the marker cannot be read, the job is offered again to be safe. The job is acked already: the
// offer is retried until it is stored or the handlers' context ends (the end of a shutdown's
// grace period).
func (r *Runner) takeWakeup(handlerCtx context.Context, job *Job, log logrus.FieldLogger) {
	ctx, cancel := context.WithTimeout(handlerCtx, settleTimeout)
	set, err := r.jobs.TakeWakeup(ctx, job.Group, job.DB)
	cancel()
	if err != nil {
		// Enqueued again to be safe, after a pause that grows while checks keep failing (the
		// wakeup stream missing, NATS down): a run must not follow a run without end.
		n := r.wakeupFailures.Add(1)
		delay := wakeupFailurePause.Delay(int(n))
		log.WithError(err).WithField("delay", delay.String()).Warn("lost-wakeup check failed: enqueueing the job again to be safe")
		if backoff.Sleep(handlerCtx, delay) != nil {
			return
		}
		set = true
	} else {
		r.wakeupFailures.Store(0)
	}
	if !set {
		return
	}
	retry := backoff.Policy{Initial: 200 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2, Jitter: 0.2}
	for attempt := 1; ; attempt++ {
		pctx, cancel := context.WithTimeout(handlerCtx, settleTimeout)
		_, err := r.jobs.Offer(pctx, job.Group, events.Job{DB: job.DB, Reason: events.ReasonWakeup})
		cancel()
		if err == nil {
			log.Debug("db changed while its job ran: job enqueued again")
			return
		}
		if backoff.Sleep(handlerCtx, retry.Delay(attempt)) != nil {
			log.WithError(err).Error("enqueue job again after a lost wakeup failed until shutdown: the db waits for its next change or sweep")
			return
		}
		log.WithError(err).WithField("attempt", attempt).Warn("enqueue job again after a lost wakeup failed: retrying")
	}
}
