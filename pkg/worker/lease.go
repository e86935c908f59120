package worker

import (
	"context"
	"errors"
	"sync"
	"time"
)

// ErrLeaseLost ends a handler whose job's lease ran out: no renewal of it was confirmed by the
// server in time (the process was paused, or NATS was unreachable), so JetStream may have handed
// the job to another consumer, which now runs it.
var ErrLeaseLost = errors.New("job lost: its lease was not renewed in time (process paused, or NATS unreachable); another instance may be running it")

// leaseMargin is how much earlier than JetStream's redelivery a lease ends: AckWait/10. A side
// effect started just before the lease ended (a webhook request, a publish) thus reaches its
// target before a successor can have started.
func leaseMargin(ackWait time.Duration) time.Duration { return ackWait / 10 }

// lease is how long this process may act on a job. JetStream hands a job to another consumer
// once AckWait has passed since the server last started the job's ack timer: when it delivered
// the job, and whenever it received an InProgress. The lease runs AckWait minus the margin from
// a moment no later than that:
//
//   - at first from when the pull request that brought the job was sent (the server delivers
//     only after receiving it);
//   - then from when each InProgress was sent whose confirmation (the server's reply) came back
//     while the lease was still held. A reply that comes later proves nothing: the server may
//     have redelivered the job before it got the InProgress, and answers it all the same.
//
// Nothing but a confirmed round trip renews it: an InProgress that nats.go buffered, or that sits
// in a stalled socket, does not count. Once it has run out it is lost for good.
type lease struct {
	ttl time.Duration // AckWait minus the margin
	now func() time.Time

	mu     sync.Mutex
	from   time.Time // send time of the last confirmed renewal, or of the pull
	lost   bool
	onLost func() // called once, by whoever first finds the lease run out
}

// newLease returns the lease of a job delivered in answer to a pull request sent at pulled.
func newLease(ackWait time.Duration, pulled time.Time, now func() time.Time) *lease {
	return &lease{ttl: ackWait - leaseMargin(ackWait), now: now, from: pulled}
}

// whenLost sets f to be called once, by the first caller of held or renewed that finds the
// lease run out, before any caller learns that it ran out: f must not use the lease. It must be
// set before the lease is shared.
func (l *lease) whenLost(f func()) { l.onLost = f }

// held reports whether the lease has not run out.
func (l *lease) held() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.heldLocked()
}

// heldLocked reports whether the lease is held; the first call that finds it run out calls
// onLost.
func (l *lease) heldLocked() bool {
	if l.lost {
		return false
	}
	if l.now().Before(l.from.Add(l.ttl)) {
		return true
	}
	l.lost = true
	if l.onLost != nil {
		l.onLost()
	}
	return false
}

// renewedAt returns when the lease was last renewed (or the pull was sent), and when it ends.
func (l *lease) renewedAt() (from, until time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.from, l.from.Add(l.ttl)
}

// renewed records an InProgress sent at sent whose confirmation has just come back. It returns
// false, and changes nothing, when the lease ran out before the confirmation came.
func (l *lease) renewed(sent time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.heldLocked() {
		return false
	}
	if sent.After(l.from) {
		l.from = sent
	}
	return true
}

// lose ends the lease at once: another instance took it (its claim was refused).
func (l *lease) lose() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lost {
		return
	}
	l.lost = true
	if l.onLost != nil {
		l.onLost()
	}
}

// Held reports whether the job is still this process's: the server confirmed recently enough
// that it keeps the job for this process, so JetStream has not handed it to another consumer.
// It turns false (and stays false) when the lease runs out: the process was paused past it
// (SIGSTOP, a frozen VM) or could not get a renewal through to NATS (a partition, a stalled
// connection). The handler's context is cancelled with ErrLeaseLost at the same moment.
// Handlers check it before each step another instance could overlap with (a webhook request, a
// publish, a checkpoint write) and act on the job no more once it is false.
func (j *Job) Held() bool { return j.lease == nil || j.lease.held() }

// Held is Job.Held for the job ctx carries (true without one).
func Held(ctx context.Context) bool {
	j, ok := FromContext(ctx)
	return !ok || j.Held()
}
