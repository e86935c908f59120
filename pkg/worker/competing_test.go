package worker

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

func TestCompetingRunnersNeverOverlapOnADB(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0)
	const dbs = 100
	type span struct{ start, end time.Time }
	var (
		mu       sync.Mutex
		spans    = map[string][]span{}
		busy     [dbs]atomic.Bool
		overlaps atomic.Int32
		perRun   [2]atomic.Int32
	)
	handler := func(runner int) Handler {
		return func(ctx context.Context, job *Job) error {
			var i int
			if _, err := fmt.Sscanf(job.DB, "db-%d", &i); err != nil {
				return Permanent(err)
			}
			if !busy[i].CompareAndSwap(false, true) {
				overlaps.Add(1)
			}
			began := time.Now()
			select {
			case <-time.After(time.Duration(1+i%5) * 4 * time.Millisecond):
			case <-ctx.Done():
			}
			busy[i].Store(false)
			mu.Lock()
			spans[job.DB] = append(spans[job.DB], span{began, time.Now()})
			mu.Unlock()
			perRun[runner].Add(1)
			return nil
		}
	}
	// Runner B has its own connection, as another process would.
	// Together they have more slots than there are dbs, so that a job enqueued again is
	// delivered at once rather than queued behind the others.
	_, jsB := e.srv.Connect(t)
	cfg := testConfig()
	cfg.Concurrency = 60
	start(t, e.newRunner(t, nil, cfg, handler(0)))
	start(t, e.newRunner(t, jsB, cfg, handler(1)))

	// Keep enqueueing every db while the runners work, as a busy producer would, until every db
	// ran three times: each db is processed again and again, by either runner.
	stopPublishing := make(chan struct{})
	published := make(chan error, 1)
	go func() {
		for round := 0; ; round++ {
			for i := range dbs {
				select {
				case <-stopPublishing:
					published <- nil
					return
				default:
				}
				if _, err := e.jobs.Publish(context.Background(), group, events.Job{DB: fmt.Sprintf("db-%d", i), Reason: fmt.Sprint(round)}); err != nil {
					published <- err
					return
				}
			}
		}
	}()
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		if len(spans) < dbs {
			return false
		}
		for _, ss := range spans {
			if len(ss) < 3 {
				return false
			}
		}
		return true
	}, waitFor, tick, "every db ran three times")
	close(stopPublishing)
	require.NoError(t, <-published)
	e.requireDrained(t)

	mu.Lock()
	defer mu.Unlock()
	assert.Len(t, spans, dbs, "every db was processed")
	total := 0
	for db, ss := range spans {
		total += len(ss)
		for i := 1; i < len(ss); i++ {
			assert.False(t, ss[i].start.Before(ss[i-1].end), "%s: run %d started before run %d ended", db, i, i-1)
		}
	}
	assert.Zero(t, overlaps.Load(), "two handlers ran the same db at once")
	assert.GreaterOrEqual(t, total, 3*dbs)
	assert.NotZero(t, perRun[0].Load(), "runner A took jobs")
	assert.NotZero(t, perRun[1].Load(), "runner B took jobs")
}
