package worker

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// jobPathCalls runs n jobs of distinct dbs through one runner and returns the JetStream API
// requests counted while they ran, by kind. With changeDuringRun, a change is offered for each
// db while its first job runs (a wakeup marker), so each db runs twice.
func jobPathCalls(t testing.TB, n int, changeDuringRun bool) map[string]int {
	t.Helper()
	e := newEnv(t, 0)
	var obs results
	cfg := testConfig()
	cfg.Observer = &obs
	cfg.queuedLong = time.Hour // the path of jobs taken at once, however loaded the machine
	var mu sync.Mutex
	var offerErrs []error
	runs := map[string]int{}
	r := e.newRunner(t, nil, cfg, func(ctx context.Context, job *Job) error {
		mu.Lock()
		runs[job.DB]++
		first := runs[job.DB] == 1
		mu.Unlock()
		if changeDuringRun && first {
			if _, err := e.jobs.Offer(ctx, group, events.Job{DB: job.DB, Reason: events.TypeUpdated}); err != nil {
				mu.Lock()
				offerErrs = append(offerErrs, err)
				mu.Unlock()
			}
		}
		return nil
	})
	counter := natstest.NewAPICounter(t, e.srv.URL())
	start(t, r)
	if b, ok := t.(*testing.B); ok {
		b.ResetTimer() // ns/op: the jobs, not the server's start
	}
	for i := range n {
		e.publish(t, fmt.Sprintf("db-%d", i), events.TypeUpdated)
	}
	want := n
	if changeDuringRun {
		want = 2 * n
	}
	deadline := time.Now().Add(waitFor + time.Duration(n)*10*time.Millisecond)
	for obs.get(ResultOK) < want || r.InFlight() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d runs done, %d in flight", obs.get(ResultOK), want, r.InFlight())
		}
		time.Sleep(tick)
	}
	counts := counter.Stop(t)
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, offerErrs)
	return counts
}

// extraCalls is what a job costs beyond its fetch (and ack, which is no API request): every
// request but the pulls and the runner's one-time look-ups of the streams it uses.
func extraCalls(counts map[string]int) int {
	n := 0
	for k, v := range counts {
		switch k {
		case "CONSUMER.MSG.NEXT", "STREAM.INFO", "CONSUMER.INFO":
		default:
			n += v
		}
	}
	return n
}

// TestJobPathCostsTwoAPIRequests: a job with no wakeup marker costs its fetch, its ack, its
// lease (a publish on the lease stream, no API request) and two JetStream API requests more:
// the lost-wakeup check, which is no write, and the lease's release (a delete of its message).
// The first version of the check cost a purge, a message get and, with a marker, a delete.
func TestJobPathCostsTwoAPIRequests(t *testing.T) {
	t.Parallel()
	const n = 20
	counts := jobPathCalls(t, n, false)
	t.Logf("JetStream API requests for %d jobs: %v", n, counts)
	assert.LessOrEqual(t, extraCalls(counts), 2*n, "at most two API requests per job beyond fetch and ack")
	assert.Zero(t, counts["STREAM.PURGE"], "no purge")
	assert.Equal(t, n, counts["STREAM.MSG.DELETE"], "one delete per job: its lease's release")
	assert.LessOrEqual(t, counts["STREAM.INFO"]+counts["CONSUMER.INFO"], 2, "streams are looked up once")
}

// BenchmarkJobPathAPICalls reports the JetStream API requests per job beyond fetch and ack
// (extra-calls/job), and the pulls per job: for jobs without a wakeup marker ("quiet"), and for
// dbs that change while their job runs ("changed"), per db (its two runs together).
func BenchmarkJobPathAPICalls(b *testing.B) {
	b.Run("quiet", func(b *testing.B) {
		counts := jobPathCalls(b, b.N, false)
		b.ReportMetric(float64(extraCalls(counts))/float64(b.N), "extra-calls/job")
		b.ReportMetric(float64(counts["CONSUMER.MSG.NEXT"])/float64(b.N), "pulls/job")
	})
	b.Run("changed", func(b *testing.B) {
		counts := jobPathCalls(b, b.N, true)
		b.ReportMetric(float64(extraCalls(counts))/float64(b.N), "extra-calls/db")
		b.ReportMetric(float64(counts["STREAM.PURGE"]+counts["STREAM.MSG.DELETE"])/float64(b.N), "writes/db")
	})
}
