package producer

import (
	"context"
	"errors"
	"io"
	"sync"
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
