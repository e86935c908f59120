package producer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// stuckDropper blocks every drop until released, failing the first fails of them.
type stuckDropper struct {
	release chan struct{}
	mu      sync.Mutex
	fails   int
	dropped []string
}

func (d *stuckDropper) DropDB(ctx context.Context, db string) error {
	select {
	case <-d.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fails > 0 {
		d.fails--
		return errors.New("nats: timeout")
	}
	d.dropped = append(d.dropped, db)
	return nil
}

// Handing deleted dbs over never waits for NATS: with every drop stuck, Add returns at once;
// once NATS answers, each db is dropped, failures retried, each db once.
func TestDeletedDBsOffTheFeedPath(t *testing.T) {
	t.Parallel()
	d := &stuckDropper{release: make(chan struct{}), fails: 2}
	m := metrics.NewProducer(prometheus.NewRegistry())
	log := logrus.New()
	log.SetOutput(io.Discard)
	dd := newDeletedDBs(d, producerMetrics{m: m}, log)
	dd.timeout = time.Hour
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); dd.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	added := make(chan struct{})
	go func() {
		for _, db := range []string{"a", "b", "c", "a"} {
			dd.Add(db)
		}
		close(added)
	}()
	select {
	case <-added:
	case <-time.After(5 * time.Second):
		t.Fatal("Add waited for a stuck drop")
	}
	assert.Equal(t, 3, dd.Pending())
	close(d.release)
	require.Eventually(t, func() bool { return dd.Pending() == 0 }, 20*time.Second, 10*time.Millisecond)
	d.mu.Lock()
	assert.ElementsMatch(t, []string{"a", "b", "c"}, d.dropped)
	d.mu.Unlock()
	assert.Equal(t, 3.0, testutil.ToFloat64(m.CheckpointsDropped))
}

// countingDropper drops every db at once and counts the drops.
type countingDropper struct{ n atomic.Int64 }

func (d *countingDropper) DropDB(context.Context, string) error { d.n.Add(1); return nil }

// The memory of deleted dbs is the dbs not dropped yet: once a burst of deletes (100,000 dbs, as
// a tenant clean-up makes) is dropped, it is given back. A Go map keeps the room of its biggest
// size, so without a fresh map the burst's room (several MiB) would stay for the process's life.
// Not parallel: it reads the process's heap.
func TestDeletedDBsGiveBackTheirMemory(t *testing.T) {
	const n = 100_000
	d := &countingDropper{}
	dd := newDeletedDBs(d, producerMetrics{}, logrus.New())
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("tenant_%07d", i)
	}
	before := liveHeap()
	for _, db := range names {
		dd.Add(db)
	}
	grown := liveHeap()
	require.Greater(t, grown-before, int64(2<<20), "the pending dbs take room (test precondition)")
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); dd.Run(ctx) }()
	require.Eventually(t, func() bool { return dd.Pending() == 0 }, time.Minute, 5*time.Millisecond)
	cancel()
	<-done
	assert.EqualValues(t, n, d.n.Load())
	left := liveHeap() - before
	t.Logf("pending %d KiB, left %d KiB", (grown-before)>>10, left>>10)
	assert.Less(t, left, int64(512<<10), "heap kept after every deleted db was dropped: %d KiB (%d KiB while pending)", left>>10, (grown-before)>>10)
	runtime.KeepAlive(names)
	runtime.KeepAlive(dd)
}

// liveHeap returns the bytes of live heap objects after a collection.
func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}
