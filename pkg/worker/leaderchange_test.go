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
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// span is one handler run of a db by one runner.
type span struct {
	runner     string
	start, end time.Time
}

// spans records handler runs, to find two runners acting on one db at once.
type spans struct {
	mu  sync.Mutex
	all []span
}

func (s *spans) add(sp span) {
	s.mu.Lock()
	s.all = append(s.all, sp)
	s.mu.Unlock()
}

// overlaps returns the pairs of runs by different runners that were under way at once.
func (s *spans) overlaps() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for i, a := range s.all {
		for _, b := range s.all[i+1:] {
			if a.runner != b.runner && a.start.Before(b.end) && b.start.Before(a.end) {
				out = append(out, fmt.Sprintf("%s %s–%s and %s %s–%s", a.runner, a.start.Format("05.000"), a.end.Format("05.000"),
					b.runner, b.start.Format("05.000"), b.end.Format("05.000")))
			}
		}
	}
	return out
}

// TestNoOverlapThroughConsumerLeaderChanges: on a three-node JetStream with replicated streams
// and consumers, two runners compete for one long job (it runs for several AckWaits, renewing
// its lease) while the consumer's leader is made to step down again and again. No two runners
// may run the job at once (SPEC §7.6): nats-server answers an InProgress before the new
// delivery time is committed, and a new leader redelivers pending jobs from the last committed
// state, so a lease that rests on InProgress alone lets the second runner in while the first
// still runs.
func TestNoOverlapThroughConsumerLeaderChanges(t *testing.T) {
	servers := natstest.StartCluster(t, 3)
	_, js := servers[0].Connect(t)
	_, js2 := servers[1].Connect(t)
	topo := natsjs.DefaultTopology("")
	topo.AckWait, topo.Replicas = 3*time.Second, 3
	require.Eventually(t, func() bool { return natsjs.Ensure(t.Context(), js, topo) == nil }, 60*time.Second, 200*time.Millisecond,
		"the replicated topology is created")
	jobs := natsjs.NewJobs(js, topo.Subjects)
	e := &env{js: js, topo: topo, jobs: jobs}

	var runs spans
	const jobLength = 10 * time.Second
	handler := func(name string) Handler {
		return func(ctx context.Context, job *Job) error {
			sp := span{runner: name, start: time.Now()}
			defer func() { sp.end = time.Now(); runs.add(sp) }()
			// A long job that acts throughout: it stops as soon as its lease is lost.
			for end := time.Now().Add(jobLength); time.Now().Before(end); {
				if !job.Held() {
					return ErrLeaseLost
				}
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(50 * time.Millisecond):
				}
			}
			return nil
		}
	}
	cfg := testConfig()
	cfg.AckWait = topo.AckWait
	start(t, e.newRunner(t, js, cfg, handler("A")))
	start(t, e.newRunner(t, js2, cfg, handler("B")))
	_, err := jobs.Publish(t.Context(), group, events.Job{DB: "long", Reason: events.TypeUpdated})
	require.NoError(t, err)

	stepdown := "$JS.API.CONSUMER.LEADER.STEPDOWN." + topo.Subjects.WorkStream() + "." + group.ConsumerName()
	deadline := time.Now().Add(2 * jobLength)
	for time.Now().Before(deadline) {
		_, _ = js.Conn().Request(stepdown, nil, 5*time.Second)
		time.Sleep(1500 * time.Millisecond) // a stepdown every half AckWait: the fault under test, paced
		if len(runs.overlaps()) > 0 {
			break
		}
	}
	require.Eventually(t, func() bool {
		info, err := js.Stream(t.Context(), topo.Subjects.WorkStream())
		return err == nil && info.CachedInfo().State.Msgs == 0
	}, 60*time.Second, 100*time.Millisecond, "the job finishes")
	assert.Empty(t, runs.overlaps(), "two runners ran the job at once")
}
