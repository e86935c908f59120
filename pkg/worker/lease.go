package worker

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// ErrLeaseLost ends a handler whose job was not kept alive in time: JetStream may have handed it
// to another consumer, which now runs it.
var ErrLeaseLost = errors.New("job lost: not kept alive within AckWait (was the process paused?); another instance may be running it")

// lease is how long JetStream keeps a job for this process: AckWait from the last InProgress
// sent. The server's deadline runs from when it received that InProgress, so the lease ends no
// later than the server's. Once it has run out it is lost for good: an InProgress sent after the
// server redelivered the job does not take it back.
type lease struct {
	ttl   time.Duration
	until atomic.Int64 // unix nanoseconds
	lost  atomic.Bool
	now   func() time.Time
}

func newLease(ttl time.Duration, now func() time.Time) *lease {
	l := &lease{ttl: ttl, now: now}
	l.until.Store(now().Add(ttl).UnixNano())
	return l
}

// held reports whether the lease has not run out.
func (l *lease) held() bool {
	if l.lost.Load() {
		return false
	}
	if l.now().UnixNano() >= l.until.Load() {
		l.lost.Store(true)
		return false
	}
	return true
}

// renewed records an InProgress sent at sent.
func (l *lease) renewed(sent time.Time) {
	if l.held() {
		l.until.Store(sent.Add(l.ttl).UnixNano())
	}
}

// Held reports whether the job is still this process's: its message was kept alive recently
// enough that JetStream has not handed it to another consumer. A process paused for longer than
// AckWait (SIGSTOP, a frozen VM) finds it false on resuming, whichever of its goroutines runs
// first; it must then not act on the job any more. Handlers check it before each step another
// instance could overlap with (a webhook request, a publish).
func (j *Job) Held() bool { return j.lease == nil || j.lease.held() }

// Held is Job.Held for the job ctx carries (true without one).
func Held(ctx context.Context) bool {
	j, ok := FromContext(ctx)
	return !ok || j.Held()
}
