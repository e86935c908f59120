package worker

import (
	"errors"
	"fmt"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Job results reported to an Observer.
const (
	ResultOK      = "ok"      // handler succeeded, job acked
	ResultRetry   = "retry"   // transient failure (or shutdown): job nak'ed for a redelivery
	ResultDelayed = "delayed" // RetryAfter without an error: deliberately run later
	ResultFailed  = "failed"  // permanent failure: dead letter recorded, job terminated
)

// Observer is told about every settled job, e.g. to count jobs by result and duration. It is
// called from many goroutines at once and must not block.
type Observer interface {
	// JobDone reports one job of group: result is one of ResultOK, ResultRetry, ResultDelayed,
	// ResultFailed; d is how long the handler ran.
	JobDone(group events.Group, result string, d time.Duration)
}

// Defaults of Config.
const (
	DefaultConcurrency = 20
	DefaultGrace       = 20 * time.Second
	maxFetchBatch      = 4
)

// DefaultRetry is the transient-error backoff: 1s doubling to 5m, 20% jitter.
func DefaultRetry() backoff.Policy {
	return backoff.Policy{Initial: time.Second, Max: 5 * time.Minute, Multiplier: 2, Jitter: 0.2}
}

// Config tunes a Runner. Only Group is required; zero values take the defaults.
type Config struct {
	// Group is the consumer group whose jobs the runner takes.
	Group events.Group
	// Concurrency bounds the jobs run at once in this process (default 20).
	Concurrency int
	// FetchBatch bounds the jobs asked for in one pull (default min(Concurrency, 4)); it is kept
	// small because a pulled job's AckWait is already running. A pull never asks for more than
	// the free slots.
	FetchBatch int
	// AckWait is the consumer's AckWait (read from the consumer when 0). A running job's lease
	// is renewed every AckWait/3 by an InProgress the server confirms, and runs out AckWait/10
	// before JetStream could redeliver the job.
	AckWait time.Duration
	// wakeupPause paces the jobs enqueued again after a failed lost-wakeup check
	// (wakeupFailurePause; tests lengthen it).
	wakeupPause backoff.Policy
	// queuedLong is how long a first delivery must have waited in the queue for its run to read
	// the db's wakeup marker before it starts (queuedMarkerRead; tests change it).
	queuedLong time.Duration
	// Grace is how long running jobs may take to finish once shutdown starts before their
	// context is cancelled and they are nak'ed (default 20s).
	Grace time.Duration
	// Retry computes the nak delay of a transient error from the delivery count (default
	// DefaultRetry()).
	Retry backoff.Policy
	// Observer, when set, is told the result and duration of every job.
	Observer Observer
	// Drained, when set, is called when the last running job ends after a burst: at least
	// BurstJobs (default max(4, Concurrency/4)) jobs ran at once since the previous call. A
	// consumer closes the idle CouchDB connections the burst opened there (an initial sync holds
	// two per running replication), instead of leaving them to their idle timeout. A quiet
	// stream of single jobs never calls it, so its connections are reused.
	Drained func()
	// BurstJobs is the number of jobs at once that makes a burst for Drained.
	BurstJobs int
}

func (c Config) withDefaults() (Config, error) {
	if c.Group == "" {
		return c, errors.New("worker config: no group")
	}
	if c.Concurrency < 0 || c.FetchBatch < 0 || c.AckWait < 0 || c.Grace < 0 {
		return c, fmt.Errorf("worker config for %s: negative concurrency, fetch batch, ack wait, grace or wakeup sweep", c.Group)
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.FetchBatch == 0 {
		c.FetchBatch = min(c.Concurrency, maxFetchBatch)
	}
	if c.BurstJobs <= 0 {
		c.BurstJobs = max(4, c.Concurrency/4)
	}
	c.FetchBatch = min(c.FetchBatch, c.Concurrency)
	if c.Grace == 0 {
		c.Grace = DefaultGrace
	}
	if c.Retry == (backoff.Policy{}) {
		c.Retry = DefaultRetry()
	}
	if c.wakeupPause == (backoff.Policy{}) {
		c.wakeupPause = wakeupFailurePause
	}
	if c.queuedLong == 0 {
		c.queuedLong = queuedMarkerRead
	}
	return c, nil
}
