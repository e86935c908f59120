package worker

import (
	"context"
	"sync/atomic"

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
	// Attempt is the delivery count of the message: 1 on the first delivery.
	Attempt int
	// Postponed is how many of the earlier deliveries the handler knows were postponements
	// (RetryAfter with a nil error, e.g. a replicator rule's dirty_after delay) rather than
	// failures. The handler sets it; Tries, and so the retry backoff, leave them out.
	Postponed int

	reached atomic.Pointer[string]
}

// Tries returns the delivery count without the postponements: 1 on the first real try. The
// runner's backoff after a transient failure and the attempts of a dead letter count it.
func (j *Job) Tries() int { return max(j.Attempt-j.Postponed, 1) }

// Reached records the db update seq (opaque) up to which the handler has fully processed the
// db; "" means the beginning (a db the handler found empty). After the ack the runner checks
// whether the db changed after it and, if so, enqueues the job again (the lost-wakeup check).
// It may be called any number of times, also concurrently; the last call wins. A handler that
// processes a db must call it before returning nil; without it no check runs.
func (j *Job) Reached(seq string) {
	j.reached.Store(&seq)
}

// ReachedSeq returns the last seq passed to Reached, or "" when Reached was not called.
func (j *Job) ReachedSeq() string {
	if p := j.reached.Load(); p != nil {
		return *p
	}
	return ""
}

// Handler processes one job. It must be idempotent (delivery is at-least-once) and return when
// ctx ends. Its result decides what happens to the job:
//
//   - nil: done; the job is acked, then the lost-wakeup check runs.
//   - RetryAfter(d, err): run again no earlier than d from now.
//   - Permanent(err): given up; a DeadLetter record is published and the job is terminated.
//   - any other error: transient; run again after the runner's backoff for Job.Attempt.
//
// ctx is not cancelled when the runner starts shutting down, only when the grace period ends;
// ctx carries the job (see FromContext).
type Handler func(ctx context.Context, job *Job) error

// WakeupChecker reports whether db has changes after seq, the seq a handler passed to
// Job.Reached. The consumers implement it with CouchDB `_changes?since=seq&limit=1`.
type WakeupChecker interface {
	ChangedSince(ctx context.Context, db, seq string) (bool, error)
}

type jobKey struct{}

// FromContext returns the job a handler's context carries.
func FromContext(ctx context.Context) (*Job, bool) {
	j, ok := ctx.Value(jobKey{}).(*Job)
	return j, ok
}

func withJob(ctx context.Context, j *Job) context.Context {
	return context.WithValue(ctx, jobKey{}, j)
}
