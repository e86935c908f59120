package publisher

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// quietChanges is a DBChanges whose feeds deliver nothing until closed.
type quietChanges struct{}

func (quietChanges) WatchChanges(ctx context.Context, _ string, _ couch.ChangesOptions, _ func(), _ func(couch.Change) error) error {
	<-ctx.Done()
	return ctx.Err()
}

func (quietChanges) Changes(context.Context, string, couch.ChangesOptions) (couch.ChangesPage, error) {
	return couch.ChangesPage{}, nil
}

// BenchmarkHotFeedsEarned runs the rule that decides which dbs earn a hot feed (HotFeeds.Seen,
// with the defaults: 32 feeds, 20 s) on the workload of bench-e2e, on a simulated clock: N dbs,
// 10 % active, 10 docs/s into random active dbs for 120 s, _db_updates announcing each db at most
// once per 500 ms batch. It reports feeds opened per written doc, the most feeds open at once,
// the share of writes that found their db's feed open (their fast path) and the streak that
// earns a feed at the end (it rises while feeds do not pay).
func BenchmarkHotFeedsEarned(b *testing.B) {
	for _, n := range []int{200, 1000, 10000, 100000} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			var opened, peak, fast, written, streak float64
			for range b.N {
				opened, peak, fast, written, streak = simulateHotFeeds(b, n, 32, 20*time.Second)
			}
			b.ReportMetric(streak, "streak")
			b.ReportMetric(opened/written, "feeds/doc")
			b.ReportMetric(peak, "feeds-peak")
			b.ReportMetric(fast/written, "fast-share")
		})
	}
}

func simulateHotFeeds(b *testing.B, n, maxFeeds int, idle time.Duration) (opened, peak, fast, written, streak float64) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	m := metrics.NewProducer(prometheus.NewRegistry())
	h := NewHotFeeds(quietChanges{}, nil, func(string) []events.Group { return []events.Group{events.GroupReplicate} },
		maxFeeds, idle, 10*time.Second, m, log)
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	h.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	ctx, cancel := context.WithCancel(context.Background())
	h.mu.Lock()
	h.ctx = ctx
	h.mu.Unlock()
	defer func() {
		cancel()
		h.mu.Lock()
		for _, f := range h.feeds {
			h.closeLocked(f, CloseStopped)
		}
		h.mu.Unlock()
		h.wg.Wait()
	}()
	rng := rand.New(rand.NewPCG(1, 2))
	active := max(1, n/10)
	const rate, batch = 10, 500 * time.Millisecond
	end := 120 * time.Second
	batchDBs := map[string]bool{}
	for step := time.Duration(0); step < end; step += time.Second / rate {
		db := fmt.Sprintf("user_%d", rng.IntN(active))
		written++
		h.mu.Lock()
		if f, ok := h.feeds[db]; ok { // its feed delivers the change
			fast++
			f.delivered++
			f.changed = h.now()
		}
		h.mu.Unlock()
		batchDBs[db] = true
		if (step+time.Second/rate)%batch == 0 { // the batch ends: one event per db written in it
			mu.Lock()
			now = now.Add(batch)
			mu.Unlock()
			for db := range batchDBs {
				h.Seen(db)
			}
			clear(batchDBs)
			h.tidy()
			peak = max(peak, float64(h.Count()))
		}
	}
	return testutil.ToFloat64(m.HotFeedsOpened), peak, fast, written, testutil.ToFloat64(m.HotFeedStreak)
}
