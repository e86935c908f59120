package worker

import (
	"context"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Job is one unit of work as a handler sees it: the group and db named by the work subject, the
// hints of the payload and the delivery count. It is never a NATS type.
type Job struct {
	Group events.Group
	DB    string
	// Reason is the payload's reason (events.ReasonWakeup, a feed event type, ...); it may be
	// empty, e.g. when the payload could not be decoded. It is a hint only.
	Reason string
	// Seq is the opaque feed sequence hint of the payload, possibly empty; never parse it.
	Seq string
	// Rules is the rule-set seq the job must run with at least (events.Job Rules; "": any).
	Rules string
	// Attempt is the delivery count of the message: 1 on the first delivery.
	Attempt int
	// Postponed is how many of the earlier deliveries the handler knows were postponements
	// (RetryAfter with a nil error, e.g. a replicator rule's dirty_after delay) rather than
	// failures. The handler sets it; Tries, and so the retry backoff, leave them out.
	Postponed int

	lease     *lease // nil: not tracked (a job made outside a Runner)
	wakeupSeq uint64 // the wakeup marker this delivery was offered for (natsjs.WakeupHeader), 0: none
}

// Tries returns the delivery count without the postponements: 1 on the first real try. The
// runner's backoff after a transient failure and the attempts of a dead letter count it.
func (j *Job) Tries() int { return max(j.Attempt-j.Postponed, 1) }

// Handler processes one job. It must be idempotent (delivery is at-least-once) and return when
// ctx ends. Its result decides what happens to the job:
//
//   - nil: done; the job is acked, then the lost-wakeup check runs (natsjs.Jobs.Offer).
//   - RetryAfter(d, err): run again no earlier than d from now.
//   - Permanent(err): given up; a DeadLetter record is published, the job is terminated, then the
//     lost-wakeup check runs (a change that came during the run makes it run again).
//   - any other error: transient; run again after the runner's backoff for Job.Attempt.
//
// ctx is not cancelled when the runner starts shutting down, only when the grace period ends;
// ctx carries the job (see FromContext).
type Handler func(ctx context.Context, job *Job) error

type jobKey struct{}

// FromContext returns the job a handler's context carries.
func FromContext(ctx context.Context) (*Job, bool) {
	j, ok := ctx.Value(jobKey{}).(*Job)
	return j, ok
}

// ContextWithJob returns ctx carrying job, as a handler's context does: for code that a handler
// calls, run outside a Runner (tests).
func ContextWithJob(ctx context.Context, job *Job) context.Context { return withJob(ctx, job) }

func withJob(ctx context.Context, j *Job) context.Context {
	return context.WithValue(ctx, jobKey{}, j)
}
