// Package publisher turns "this db changed" into jobs stored in the JetStream work queue, for the
// producer (pkg/producer). Its Pipeline publishes the jobs of each db-updates feed position
// asynchronously and settles the answers in feed order, so that the position it calls safe never
// passes a job JetStream has not acknowledged (SPEC §4.5). Its HotFeeds keep _changes feeds open
// on busy dbs and publish their jobs ahead of the db-updates feed, holding the saved position
// before the events they stand for until their own jobs are acknowledged.
package publisher

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

// AckTimeout bounds the wait for JetStream's answer to one asynchronous publish, counted from the
// publish; a publish without an answer by then is published again (a duplicate is harmless).
// Counted from the publish, not from when the settling gets to it: answers lost together (a
// stream leader that died with them) time out together, instead of one after the other.
const AckTimeout = 30 * time.Second

// Jobs publishes jobs to the work stream (*natsjs.Jobs): asynchronously, then, when the
// answer says a job is pending, or when the publish failed, with the wakeup marker (Offer).
type Jobs interface {
	PublishAsync(g events.Group, job events.Job) (jetstream.PubAckFuture, error)
	MarkAndRetry(ctx context.Context, g events.Group, job events.Job) (deduplicated bool, err error)
	Offer(ctx context.Context, g events.Group, job events.Job) (deduplicated bool, err error)
	Publish(ctx context.Context, g events.Group, job events.Job) (deduplicated bool, err error)
}

// Pipeline is the producer's publish pipeline. Enqueue publishes a position's jobs
// asynchronously (many in flight); a single settling goroutine reads the answers in enqueue
// order, republishes what failed until it succeeds, and only then advances the safe position.
// So Safe() never passes a seq whose jobs are not all acknowledged by JetStream (SPEC §4.5).
type Pipeline struct {
	jobs       Jobs
	log        logrus.FieldLogger
	metrics    producerMetrics
	pending    chan *batch
	ackTimeout time.Duration

	mu   sync.Mutex
	safe string
	// due counts settled positions that make a save due (see Enqueue); the saver compares it
	// with the count it last saved.
	due uint64
	// holds are the claims of covered events on the saved position (see Covered), in feed
	// order: the position saved stays before the oldest one not released.
	holds []*Hold
	// settled counts batches fully settled; enqueued counts batches handed in. Equal → idle.
	settled  atomic.Int64
	enqueued atomic.Int64
	done     chan struct{}
}

// Hold is the claim of one covered event (Covered) on the saved position: the position saved
// stays before the event until the Hold is released (Release), which the caller does once a job
// of the event's db, published after the event was read, is settled — acknowledged by
// JetStream, or stood for by a pending job and its wakeup marker. No clock releases it: a
// producer that stops first leaves the position before the event, and its successor reads the
// event again. Its fields are guarded by Pipeline.mu.
type Hold struct {
	released bool
	placed   bool   // the covered event settled while the hold was not released yet
	before   string // the safe position before the event (set when placed)
}

// batch is one feed position and the publishes it caused.
type batch struct {
	seq     string
	hasSeq  bool
	saveDue bool  // a position that, once reached, is worth saving
	hold    *Hold // an event a hot feed stands for: no jobs, and a hold on the saved position
	jobs    []pendingJob
	settled chan struct{} // closed when settled, if the caller wants to wait (may be nil)
	after   func()        // called once settled, in the settling goroutine (may be nil)
}

type pendingJob struct {
	group  events.Group
	job    events.Job
	future jetstream.PubAckFuture
	sent   time.Time // when future was published: its answer is due by sent + ackTimeout
	err    error     // from PublishAsync itself
	// noMarker: a refusal (a job for the db is pending or running) leaves no wakeup marker
	// (EnqueueSweep)
	noMarker bool
}

// New returns a pipeline publishing through jobs (*natsjs.Jobs) with at most maxInflight feed
// positions unsettled; m (nil: none) counts its publishes.
func New(jobs Jobs, maxInflight int, m *metrics.Producer, log logrus.FieldLogger) *Pipeline {
	return &Pipeline{
		jobs:       jobs,
		log:        log,
		metrics:    producerMetrics{m: m},
		pending:    make(chan *batch, maxInflight),
		ackTimeout: AckTimeout,
		done:       make(chan struct{}),
	}
}

// Enqueue publishes one job per group for db and records seq as reached once they are
// acknowledged. It blocks when maxInflight batches are unsettled (back-pressure on the feed).
// saveDue says whether reaching seq is worth a save of the position: events of the spiegel db
// itself are not (saving the position writes to it, which would be an event again).
func (p *Pipeline) Enqueue(ctx context.Context, seq string, saveDue bool, db, reason string, groups []events.Group) error {
	b := &batch{seq: seq, hasSeq: true, saveDue: saveDue}
	p.publish(b, db, reason, seq, groups)
	return p.push(ctx, b)
}

// EnqueueNoSeq publishes one job per group for db, not tied to a feed position (sweeps, rules).
func (p *Pipeline) EnqueueNoSeq(ctx context.Context, db, reason string, groups []events.Group) error {
	b := &batch{}
	p.publish(b, db, reason, "", groups)
	return p.push(ctx, b)
}

// EnqueueSweep is EnqueueNoSeq for the reconciliation sweep: a publish refused because a job
// for (group, db) is pending or running leaves no wakeup marker. A pending job reads the db
// after the sweep did; a running one was started by an event whose later changes have events
// (and markers) of their own, and if those were lost too, the next sweep sees the db again. A
// marker would instead cost every db whose job was queued a second run: right after a start,
// while the rules' catch-up jobs are queued, that is every matched db.
func (p *Pipeline) EnqueueSweep(ctx context.Context, db string, groups []events.Group) error {
	b := &batch{}
	p.publish(b, db, events.ReasonSweep, "", groups)
	for i := range b.jobs {
		b.jobs[i].noMarker = true
	}
	return p.push(ctx, b)
}

// Covered records seq as reached without publishing anything: a hot feed of the event's db stands
// for it (see HotFeeds). Saves of the position stay before it until h is released
// (SaveCandidate): should the process die before a job published after the event is settled,
// the next producer reads the event again from the feed.
func (p *Pipeline) Covered(ctx context.Context, seq string, h *Hold) error {
	return p.push(ctx, &batch{seq: seq, hasSeq: true, saveDue: true, hold: h})
}

// Release releases holds: a job of their db, published after their events were read, is
// settled. The saved position may then pass their events.
func (p *Pipeline) Release(holds []*Hold) {
	if len(holds) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range holds {
		h.released = true
	}
}

// Holds returns the number of holds on the saved position not released yet.
func (p *Pipeline) Holds() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.compactLocked()
	return len(p.holds)
}

// compactLocked drops the released holds.
func (p *Pipeline) compactLocked() {
	p.holds = slices.DeleteFunc(p.holds, func(h *Hold) bool { return h.released })
}

// EnqueueThen publishes one job per group for db, not tied to a feed position, and calls after
// once they are settled (in the settling goroutine: after must not block).
func (p *Pipeline) EnqueueThen(ctx context.Context, db, reason string, groups []events.Group, after func()) error {
	b := &batch{after: after}
	p.publish(b, db, reason, "", groups)
	return p.push(ctx, b)
}

// Flush waits until everything enqueued before it is settled.
func (p *Pipeline) Flush(ctx context.Context) error {
	return p.EnqueueWait(ctx, "", "", nil)
}

func (p *Pipeline) publish(b *batch, db, reason, seq string, groups []events.Group) {
	if len(groups) > 0 {
		now := time.Now()
		b.jobs = make([]pendingJob, len(groups))
		for i, g := range groups {
			j := events.Job{DB: db, Reason: reason, Seq: seq, At: now.UTC()}
			f, err := p.jobs.PublishAsync(g, j)
			b.jobs[i] = pendingJob{group: g, job: j, future: f, sent: now, err: err}
		}
	}
}

// EnqueueWait is Enqueue that waits until the jobs are settled.
func (p *Pipeline) EnqueueWait(ctx context.Context, db, reason string, groups []events.Group) error {
	b := &batch{settled: make(chan struct{})}
	now := time.Now()
	for _, g := range groups {
		j := events.Job{DB: db, Reason: reason, At: now.UTC()}
		f, err := p.jobs.PublishAsync(g, j)
		b.jobs = append(b.jobs, pendingJob{group: g, job: j, future: f, sent: now, err: err})
	}
	if err := p.push(ctx, b); err != nil {
		return err
	}
	select {
	case <-b.settled:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *Pipeline) push(ctx context.Context, b *batch) error {
	p.enqueued.Add(1)
	select {
	case p.pending <- b:
		return nil
	case <-ctx.Done():
		p.enqueued.Add(-1)
		return ctx.Err()
	}
}

// Safe returns the newest seq whose jobs, and all jobs before them, are acknowledged.
func (p *Pipeline) Safe() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.safe
}

// SafeDue returns Safe and how many positions that make a save due have been reached so far: a
// save is due when the count differs from the one at the last save.
func (p *Pipeline) SafeDue() (string, uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.safe, p.due
}

// SaveCandidate returns the position a save may write: Safe, unless a covered event's hold is
// not released yet, then the safe position before the oldest such event (held true). It also
// returns the due count (see SafeDue).
func (p *Pipeline) SaveCandidate() (seq string, due uint64, held bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.compactLocked()
	if len(p.holds) > 0 {
		return p.holds[0].before, p.due, true
	}
	return p.safe, p.due, false
}

// SetSafe sets the starting position (the saved one) before Run.
func (p *Pipeline) SetSafe(seq string) {
	p.mu.Lock()
	p.safe = seq
	p.mu.Unlock()
}

// InFlight returns the number of enqueued feed positions whose jobs are not all settled yet.
func (p *Pipeline) InFlight() int { return int(p.enqueued.Load() - p.settled.Load()) }

// Idle reports whether every enqueued batch is settled.
func (p *Pipeline) Idle() bool { return p.settled.Load() == p.enqueued.Load() }

// Run settles batches in order until ctx ends and the queue is empty. After ctx ends it keeps
// settling what was enqueued, for up to grace, so a shutdown saves as far as it can.
func (p *Pipeline) Run(ctx context.Context, grace time.Duration) {
	defer close(p.done)
	// settleCtx outlives ctx by grace, so in-flight publishes get their answers on shutdown.
	settleCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	go func() {
		<-ctx.Done()
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-p.done:
		}
	}()
	for {
		select {
		case b := <-p.pending:
			if !p.settle(settleCtx, b) {
				return
			}
		case <-ctx.Done():
			for {
				select {
				case b := <-p.pending:
					if !p.settle(settleCtx, b) {
						return
					}
				default:
					return
				}
			}
		}
	}
}

// settle waits for every job of b, republishing failures with backoff. It returns false when
// settleCtx ended first (b is then not settled and the position does not move past it).
func (p *Pipeline) settle(ctx context.Context, b *batch) bool {
	for i := range b.jobs {
		if !p.settleJob(ctx, &b.jobs[i]) {
			return false
		}
	}
	if b.hasSeq {
		p.mu.Lock()
		if h := b.hold; h != nil && !h.released && !h.placed {
			h.placed, h.before = true, p.safe
			p.holds = append(p.holds, h)
		}
		p.safe = b.seq
		if b.saveDue {
			p.due++
		}
		p.mu.Unlock()
	}
	p.settled.Add(1)
	if b.settled != nil {
		close(b.settled)
	}
	if b.after != nil {
		b.after()
	}
	return true
}

func (p *Pipeline) settleJob(ctx context.Context, j *pendingJob) bool {
	err := j.err
	if err == nil && j.future != nil {
		answered, aerr := p.answer(ctx, j)
		if answered && aerr == nil {
			p.metrics.published(j.group)
			return true
		}
		if !answered && ctx.Err() != nil {
			return false
		}
		err = aerr
	}
	if natsjs.IsDuplicateJob(err) && j.noMarker {
		p.metrics.settled(j.group, true)
		return true
	}
	if natsjs.IsDuplicateJob(err) {
		// A job for the db is pending or running: leave the wakeup marker (natsjs.Jobs.Offer).
		var dedup bool
		pubCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		dedup, err = p.jobs.MarkAndRetry(pubCtx, j.group, j.job)
		cancel()
		if err == nil {
			p.metrics.settled(j.group, dedup)
			return true
		}
	}
	for attempt := 1; ; attempt++ {
		if errors.Is(err, context.Canceled) && ctx.Err() != nil {
			return false
		}
		p.metrics.publishError(j.group)
		entry := p.log.WithFields(logrus.Fields{"group": j.group, "db": j.job.DB, "attempt": attempt}).WithError(err)
		if attempt == 1 {
			// The first retry goes out at once: this goroutine settles every job in order, so a
			// wait here holds up every job behind this one, and the feed behind them. In a chaos
			// run, after a NATS leader was killed, about one asynchronous publish in seven was
			// answered "no responders" for minutes while a publish right after it was stored: at
			// about four a second, a quarter-second wait on each held up the settling most of
			// the time.
			entry.Debug("publish job failed, retrying at once")
		} else {
			entry.Warn("publish job failed, retrying")
			if backoff.Sleep(ctx, backoff.Default.Delay(attempt-1)) != nil {
				return false
			}
		}
		pubCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var dedup bool
		if j.noMarker {
			dedup, err = p.jobs.Publish(pubCtx, j.group, j.job)
		} else {
			dedup, err = p.jobs.Offer(pubCtx, j.group, j.job)
		}
		cancel()
		if err == nil {
			p.metrics.settled(j.group, dedup)
			return true
		}
	}
}

// answer waits for the answer to j's asynchronous publish until it is due (sent + ackTimeout):
// answered and JetStream's error (nil: stored), or not answered and why (the answer is overdue,
// or ctx ended). An answer already there is taken even when it is overdue.
func (p *Pipeline) answer(ctx context.Context, j *pendingJob) (answered bool, err error) {
	select {
	case <-j.future.Ok():
		return true, nil
	case err := <-j.future.Err():
		return true, err
	default:
	}
	timer := time.NewTimer(time.Until(j.sent.Add(p.ackTimeout)))
	defer timer.Stop()
	select {
	case <-j.future.Ok():
		return true, nil
	case err := <-j.future.Err():
		return true, err
	case <-timer.C:
		return false, fmt.Errorf("publish %s job for %q: no answer from JetStream within %s", j.group, j.job.DB, p.ackTimeout)
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// Wait blocks until Run has returned.
func (p *Pipeline) Wait() { <-p.done }
