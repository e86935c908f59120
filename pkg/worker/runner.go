package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

const (
	// lookupTimeout bounds New's consumer lookup.
	lookupTimeout = 10 * time.Second
	// fetchWait is how long one pull request waits for jobs at the server (at most AckWait/4: a
	// job's lease runs from when the pull was sent). Short pulls keep an idle runner quick to
	// notice a restarted server; they cost one request per interval.
	fetchWait = 5 * time.Second
	// fetchHeartbeat lets a pull notice a dead connection or server within 2 heartbeats.
	fetchHeartbeat = time.Second
	// abandonAfter is how long Run still waits, after cancelling handlers at the end of the
	// grace period, for them to return; a handler that ignores its ctx longer is abandoned
	// and its job redelivered after AckWait.
	abandonAfter = 5 * time.Second
)

// Runner takes the jobs of one group from its durable consumer and runs them with a Handler.
// Several runners, in one process or many, may share the consumer: each job goes to one of them.
type Runner struct {
	cfg         Config
	nc          *nats.Conn // keeps deliveries alive: InProgress
	js          jetstream.JetStream
	consumer    jetstream.Consumer
	handler     Handler
	jobs        *natsjs.Jobs
	deadLetters *DeadLetters
	subjects    events.Subjects
	log         logrus.FieldLogger
	now         func() time.Time // the clock of job leases (a test moves it past AckWait)

	inFlight     atomic.Int64
	peak         atomic.Int64 // most jobs in flight at once since Drained was last called
	running      atomic.Bool
	wakeupStreak backoff.Streak // lost-wakeup checks failing since
}

// New returns a runner for cfg.Group's durable consumer on the work stream. It looks the
// consumer up (within 10s) and returns an error wrapping natsjs.ErrNotInstalled when the stream
// or the consumer is missing.
func New(js jetstream.JetStream, subjects events.Subjects, cfg Config, h Handler, log logrus.FieldLogger) (*Runner, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if h == nil {
		return nil, fmt.Errorf("worker for %s: no handler", cfg.Group)
	}
	ctx, cancel := context.WithTimeout(context.Background(), lookupTimeout)
	defer cancel()
	name := cfg.Group.ConsumerName()
	consumer, err := js.Consumer(ctx, subjects.WorkStream(), name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, fmt.Errorf("look up consumer %s: stream %s is missing: %w", name, subjects.WorkStream(), natsjs.ErrNotInstalled)
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		return nil, fmt.Errorf("look up consumer %s on stream %s: %w", name, subjects.WorkStream(), natsjs.ErrNotInstalled)
	case err != nil:
		return nil, fmt.Errorf("look up consumer %s on stream %s: %w", name, subjects.WorkStream(), err)
	}
	if cfg.AckWait == 0 {
		cfg.AckWait = consumer.CachedInfo().Config.AckWait
	}
	if cfg.AckWait <= 0 {
		cfg.AckWait = 30 * time.Second // the server's default
	}
	return &Runner{
		cfg:         cfg,
		nc:          js.Conn(),
		js:          js,
		consumer:    consumer,
		handler:     h,
		jobs:        natsjs.NewJobs(js, subjects),
		deadLetters: NewDeadLetters(js, subjects),
		subjects:    subjects,
		log:         log.WithField("group", string(cfg.Group)),
		now:         time.Now,
	}, nil
}

// InFlight returns the number of jobs this runner holds: running, or being settled.
func (r *Runner) InFlight() int { return int(r.inFlight.Load()) }

// Run takes and runs jobs until ctx ends. It pulls only as many jobs as it has free slots
// (Config.Concurrency), so no job waits in a local buffer while its AckWait runs. Errors
// talking to NATS (server down, consumer deleted for a while) are logged and retried with
// backoff; they never end Run.
//
// When ctx ends, Run stops pulling at once. Running handlers keep an uncancelled context for
// up to Config.Grace and their results are applied as usual; then their context is cancelled,
// and a job whose handler returns after that is nak'ed for an immediate redelivery (never
// acked). Run returns nil once every job it took is settled (a handler that ignores its
// cancelled context for more than 5s is abandoned: its job is redelivered after AckWait). The
// caller drains the NATS connection afterwards. Run must not be called twice at once.
func (r *Runner) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return fmt.Errorf("run %s worker: already running", r.cfg.Group)
	}
	defer r.running.Store(false)

	// Handlers outlive ctx by the grace period: their context only ends with cancelHandlers.
	handlerCtx, cancelHandlers := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelHandlers()
	slots := make(chan struct{}, r.cfg.Concurrency)
	var wg sync.WaitGroup

	r.log.WithField("concurrency", r.cfg.Concurrency).Info("worker started")
	r.pullLoop(ctx, handlerCtx, slots, &wg)

	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	r.log.WithField("in_flight", r.InFlight()).Info("worker stopping: waiting for running jobs")
	grace := time.NewTimer(r.cfg.Grace)
	defer grace.Stop()
	select {
	case <-done:
		r.log.Info("worker stopped")
		return nil
	case <-grace.C:
	}
	r.log.WithField("in_flight", r.InFlight()).Warn("grace period over: cancelling running jobs")
	cancelHandlers()
	abandon := time.NewTimer(abandonAfter)
	defer abandon.Stop()
	select {
	case <-done:
		r.log.Info("worker stopped")
	case <-abandon.C:
		r.log.WithField("in_flight", r.InFlight()).Error("jobs ignore their cancelled context: abandoned, they run again after AckWait")
	}
	return nil
}

// pullLoop pulls and starts jobs until ctx ends.
func (r *Runner) pullLoop(ctx, handlerCtx context.Context, slots chan struct{}, wg *sync.WaitGroup) {
	retry := backoff.Default
	failures := 0
	for {
		n := r.acquire(ctx, slots)
		if n == 0 {
			return
		}
		err := r.pull(ctx, handlerCtx, n, slots, wg)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			failures = 0
			continue
		}
		failures++
		r.log.WithError(err).WithField("attempt", failures).Warn("pull jobs failed, retrying")
		if backoff.Sleep(ctx, retry.Delay(failures)) != nil {
			return
		}
	}
}

// acquire waits for one free slot, then takes up to FetchBatch-1 more if they are free at once.
// It returns how many it took: 0 when ctx ended first.
func (r *Runner) acquire(ctx context.Context, slots chan struct{}) int {
	if ctx.Err() != nil {
		return 0
	}
	select {
	case slots <- struct{}{}:
	case <-ctx.Done():
		return 0
	}
	n := 1
	for n < r.cfg.FetchBatch {
		select {
		case slots <- struct{}{}:
			n++
		default:
			return n
		}
	}
	return n
}

func release(slots chan struct{}, n int) {
	for range n {
		<-slots
	}
}

// started counts a job in flight and keeps the peak.
func (r *Runner) started() {
	n := r.inFlight.Add(1)
	for {
		p := r.peak.Load()
		if n <= p || r.peak.CompareAndSwap(p, n) {
			return
		}
	}
}

// ended counts a job out; the last of a burst calls Config.Drained.
func (r *Runner) ended() {
	if r.inFlight.Add(-1) == 0 && r.cfg.Drained != nil && r.peak.Load() >= int64(r.cfg.BurstJobs) {
		r.peak.Store(0)
		r.cfg.Drained()
	}
}

// pull asks for n jobs, n slots being reserved for them, and starts each job as it arrives; the
// slots of jobs that did not come are released. When ctx ends the pull is withdrawn at once; a
// job that still arrives is nak'ed, except one the server sent in the very instant of the
// withdrawal, which nats.go drops: it runs again after AckWait.
func (r *Runner) pull(ctx, handlerCtx context.Context, n int, slots chan struct{}, wg *sync.WaitGroup) error {
	pullCtx, cancel := context.WithTimeout(ctx, min(fetchWait, r.cfg.AckWait/4))
	defer cancel()
	if pullCtx.Err() != nil {
		release(slots, n)
		return nil
	}
	opts := []jetstream.FetchOpt{jetstream.FetchContext(pullCtx)}
	if deadline, ok := pullCtx.Deadline(); ok && time.Until(deadline) > 3*fetchHeartbeat {
		opts = append(opts, jetstream.FetchHeartbeat(fetchHeartbeat))
	}
	pulled := r.now() // the server delivers no job before it got the pull: the jobs' leases start here
	batch, err := r.consumer.Fetch(n, opts...)
	if err != nil {
		release(slots, n)
		return fmt.Errorf("pull from consumer %s: %w", r.cfg.Group.ConsumerName(), err)
	}
	got := 0
	for msg := range batch.Messages() {
		got++
		if ctx.Err() != nil {
			if err := msg.Nak(); err != nil {
				r.log.WithError(err).Warn("nak job pulled during shutdown failed: it runs again after AckWait")
			}
			<-slots
			continue
		}
		r.started()
		wg.Add(1)
		go func() {
			defer wg.Done()
			var then func()
			func() {
				defer func() { r.ended(); <-slots }()
				then = r.process(handlerCtx, msg, pulled)
			}()
			if then != nil {
				then() // the job's slot is free again meanwhile
			}
		}()
	}
	release(slots, n-got)
	if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("pull from consumer %s: %w", r.cfg.Group.ConsumerName(), err)
	}
	return nil
}
