package natsjs

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

func TestEnsureIsIdempotentAndConcurrent(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := DefaultTopology("")
	require.ErrorIs(t, CheckInstalled(t.Context(), js, topo, events.Groups...), ErrNotInstalled)

	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = Ensure(t.Context(), js, topo)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, Ensure(t.Context(), js, topo))
	require.NoError(t, CheckInstalled(t.Context(), js, topo, events.Groups...))

	info, err := js.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err)
	cfg := info.CachedInfo().Config
	assert.Equal(t, jetstream.WorkQueuePolicy, cfg.Retention)
	assert.Equal(t, int64(1), cfg.MaxMsgsPerSubject)
	assert.True(t, cfg.DiscardNewPerSubject)

	// The buckets are read at their leader: a replica's direct get can answer with an older
	// revision, which makes the compare-and-set of the next write fail.
	for _, bucket := range []string{topo.Subjects.OnChangeBucket(), topo.Subjects.DoneBucket()} {
		st, err := js.Stream(t.Context(), "KV_"+bucket)
		require.NoError(t, err)
		assert.False(t, st.CachedInfo().Config.AllowDirect, "bucket %s allows direct gets", bucket)
		kv, err := js.KeyValue(t.Context(), bucket)
		require.NoError(t, err)
		rev, err := kv.Put(t.Context(), "k", []byte("v"))
		require.NoError(t, err)
		got, err := kv.Get(t.Context(), "k")
		require.NoError(t, err)
		assert.Equal(t, rev, got.Revision())
	}

	require.NoError(t, Remove(t.Context(), js, topo))
	require.ErrorIs(t, CheckInstalled(t.Context(), js, topo), ErrNotInstalled)
	require.NoError(t, Remove(t.Context(), js, topo))
}

func TestOnePendingJobPerGroupAndDB(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := DefaultTopology("")
	require.NoError(t, Ensure(t.Context(), js, topo))
	jobs := NewJobs(js, topo.Subjects)
	ctx := t.Context()

	dedup, err := jobs.Publish(ctx, events.GroupReplicate, events.Job{DB: "a/b+c$d"})
	require.NoError(t, err)
	assert.False(t, dedup)
	dedup, err = jobs.Publish(ctx, events.GroupReplicate, events.Job{DB: "a/b+c$d"})
	require.NoError(t, err)
	assert.True(t, dedup, "second publish while one is pending is deduplicated")
	dedup, err = jobs.Publish(ctx, events.GroupOnChange, events.Job{DB: "a/b+c$d"})
	require.NoError(t, err)
	assert.False(t, dedup, "the other group has its own slot")

	f, err := jobs.PublishAsync(events.GroupReplicate, events.Job{DB: "a/b+c$d"})
	require.NoError(t, err)
	select {
	case <-f.Ok():
		t.Fatal("async duplicate was accepted")
	case err := <-f.Err():
		assert.True(t, IsDuplicateJob(err), "got %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("no answer to async publish")
	}

	// Fetch without ack: the slot is still held; after the ack it is free again.
	cons, err := js.Consumer(ctx, topo.Subjects.WorkStream(), "replicator")
	require.NoError(t, err)
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	var msg jetstream.Msg
	for m := range batch.Messages() {
		msg = m
	}
	require.NotNil(t, msg)
	g, db, err := topo.Subjects.ParseWork(msg.Subject())
	require.NoError(t, err)
	assert.Equal(t, events.GroupReplicate, g)
	assert.Equal(t, "a/b+c$d", db)
	dedup, err = jobs.Publish(ctx, events.GroupReplicate, events.Job{DB: "a/b+c$d"})
	require.NoError(t, err)
	assert.True(t, dedup, "a delivered, unacked job still holds the slot")
	require.NoError(t, msg.DoubleAck(ctx))
	dedup, err = jobs.Publish(ctx, events.GroupReplicate, events.Job{DB: "a/b+c$d"})
	require.NoError(t, err)
	assert.False(t, dedup, "ack frees the slot")
}

func TestConnectWaitsForContext(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 700*time.Millisecond)
	defer cancel()
	log := logrus.New()
	log.SetLevel(logrus.PanicLevel)
	_, err := Connect(ctx, Options{URLs: "nats://user:SECRETPW@127.0.0.1:1"}, log)
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "SECRETPW")
}

// TestFullStreamIsNotADuplicate: a work stream that cannot store a job (here: full, MaxBytes)
// answers with the same error code 10077 as the per-subject rejection; only the latter is a
// duplicate. A full stream is a failure that the publisher must report, not count as done.
func TestFullStreamIsNotADuplicate(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	topo := DefaultTopology("")
	cfg := topo.WorkStreamConfig()
	cfg.MaxBytes = 600
	_, err := js.CreateStream(t.Context(), cfg)
	require.NoError(t, err)
	jobs := NewJobs(js, topo.Subjects)
	ctx := t.Context()

	dedup, err := jobs.Publish(ctx, events.GroupReplicate, events.Job{DB: "first"})
	require.NoError(t, err)
	assert.False(t, dedup)
	dedup, err = jobs.Publish(ctx, events.GroupReplicate, events.Job{DB: "first"})
	require.NoError(t, err, "the per-subject rejection is a duplicate")
	assert.True(t, dedup)

	var full error
	for i := 0; i < 100 && full == nil; i++ {
		_, full = jobs.Publish(ctx, events.GroupReplicate, events.Job{DB: fmt.Sprintf("other_%03d", i)})
	}
	require.Error(t, full, "the stream never filled up")
	var apiErr *jetstream.APIError
	require.ErrorAs(t, full, &apiErr)
	assert.Equal(t, ErrCodeStoreFailed, apiErr.ErrorCode, "a full stream carries the same code")
	assert.False(t, IsDuplicateJob(full), "a full stream is not a duplicate: %v", full)

	f, err := jobs.PublishAsync(events.GroupOnChange, events.Job{DB: "async"})
	require.NoError(t, err)
	select {
	case <-f.Ok():
		t.Fatal("a full stream stored the job")
	case err := <-f.Err():
		assert.False(t, IsDuplicateJob(err), "asynchronous answer: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no answer")
	}
}
