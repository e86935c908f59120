package main

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/healthtest"
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

// Deleting a db an on_change rule matches drops its cached checkpoints, of every rule, and
// leaves nothing in the bucket; deleting a db no on_change rule matches sends nothing to NATS.
func TestDeletedDBDropsCachedCheckpoints(t *testing.T) {
	e := newEnv(t)
	e.cfg.HTTPAddr = healthtest.FreeAddr(t)
	watched, unwatched, kept := e.Prefix+"watched", e.Prefix+"unwatched", e.Prefix+"kept"
	for _, db := range []string{watched, unwatched, kept} {
		e.Couch.CreateDB(t, db)
	}
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^" + e.Prefix + "(watched|kept)$", "url": "http://127.0.0.1:1/"})
	kv, err := e.JS.KeyValue(t.Context(), "SPIEGEL_ONCHANGE")
	require.NoError(t, err)
	key := func(rule, db string) string {
		enc := base64.RawURLEncoding
		return enc.EncodeToString([]byte(rule)) + "." + enc.EncodeToString([]byte(db))
	}
	for _, k := range []string{key("hook", watched), key("old", watched), key("hook", kept), key("old", unwatched)} {
		_, err := kv.Put(t.Context(), k, []byte(`{"last_seq":"1"}`))
		require.NoError(t, err)
	}
	e.startProducer(t)
	e.waitJob(t, onc, watched, 20*time.Second)
	for _, db := range []string{watched, unwatched} {
		require.NoError(t, e.Couch.Client.DestroyDB(t.Context(), db))
	}
	require.Eventually(t, func() bool {
		return metric(t, e.cfg.HTTPAddr, "spiegel_deleted_db_checkpoints_dropped_total") == 1
	}, 20*time.Second, 20*time.Millisecond, "the deleted db's checkpoints were not dropped")
	for _, k := range []string{key("hook", watched), key("old", watched)} {
		_, err := kv.Get(t.Context(), k)
		assert.ErrorIs(t, err, jetstream.ErrKeyNotFound)
	}
	s, err := e.JS.Stream(t.Context(), "KV_SPIEGEL_ONCHANGE")
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	assert.Equal(t, uint64(2), info.State.Msgs, "the kept entries only: no marker left behind")
	_, err = kv.Get(t.Context(), key("old", unwatched))
	assert.NoError(t, err, "a db no on_change rule matches is not looked at")
}
