package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// fenceKey is the key of replication id's token: checkpoint.ReplicationKey(rule, id, db), with
// the rule and the db (the job's, the replication's source) from ctx, so that dropping a deleted
// db's cached checkpoints (checkpoint.CacheDropper.DropDB) drops its tokens too, and a rule
// removed or edited takes its tokens with it (CacheDropper.DropRule). Without a job in ctx (no
// worker runs it) the db is "", without a rule the rule is "".
func fenceKey(ctx context.Context, id string) string {
	db := ""
	if job, ok := worker.FromContext(ctx); ok {
		db = job.DB
	}
	rule, _ := ctx.Value(ruleKey{}).(string)
	return checkpoint.ReplicationKey(rule, id, db)
}

type ruleKey struct{}

// withRule returns ctx naming the rule whose replication runs in it (fenceKey).
func withRule(ctx context.Context, rule string) context.Context {
	return context.WithValue(ctx, ruleKey{}, rule)
}

// kvFence keeps the fencing token of each native replication (replicate.Fence) as the revision
// of a NATS key-value entry (fenceKey) in the bucket of the on_change checkpoints: a run reads
// it when it starts and moves it by compare-and-set before each checkpoint write, so a run that
// lost its job to a newer one cannot write its checkpoint over the newer run's, on Apache
// CouchDB too (which does not check the revs of _local docs). A deleted db's tokens go with its
// cached checkpoints: nothing of it stays in the bucket, and a run of an earlier incarnation
// cannot advance the token of a run of the db created again (the entry it read is gone). The
// bucket is opened on first use; a missing one fails the run (run `producer install`).
//
// Every NATS request here has a deadline of its own (fenceTimeout), not the run's (up to
// SPIEGEL_REPLICATION_TIMEOUT): an answer lost when a NATS node dies is never delivered, and a
// request waiting for it held its job for minutes. No lock is held during a request, so one that
// waits holds up no other job.
type kvFence struct {
	js   jetstream.JetStream
	topo natsjs.Topology
	mu   sync.Mutex
	kv   jetstream.KeyValue
}

// fenceTimeout bounds each NATS request of kvFence.
const fenceTimeout = 10 * time.Second

func (f *kvFence) bucket(ctx context.Context) (jetstream.KeyValue, error) {
	f.mu.Lock()
	kv := f.kv
	f.mu.Unlock()
	if kv != nil {
		return kv, nil
	}
	ctx, cancel := context.WithTimeout(ctx, fenceTimeout)
	defer cancel()
	kv, err := natsjs.OnChangeBucket(ctx, f.js, f.topo) // jobs starting at once may each open it: harmless
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.kv == nil {
		f.kv = kv
	}
	return f.kv, nil
}

// Token returns the replication's token (0: none yet).
func (f *kvFence) Token(ctx context.Context, id string) (uint64, error) {
	kv, err := f.bucket(ctx)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, fenceTimeout)
	defer cancel()
	e, err := kv.Get(ctx, fenceKey(ctx, id))
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return 0, nil
	case err != nil:
		return 0, fmt.Errorf("read the fencing token of replication %s: %w", id, err)
	}
	return e.Revision(), nil
}

// Advance moves the token from token (0: none, the entry must not exist) to a new revision.
func (f *kvFence) Advance(ctx context.Context, id string, token uint64) (uint64, bool, error) {
	kv, err := f.bucket(ctx)
	if err != nil {
		return 0, false, err
	}
	ctx, cancel := context.WithTimeout(ctx, fenceTimeout)
	defer cancel()
	v := []byte(time.Now().UTC().Format(time.RFC3339Nano))
	var next uint64
	if token == 0 {
		next, err = kv.Create(ctx, fenceKey(ctx, id), v)
	} else {
		next, err = kv.Update(ctx, fenceKey(ctx, id), v, token)
	}
	switch {
	case errors.Is(err, jetstream.ErrKeyExists) || natsjs.IsWrongLastSequence(err):
		return 0, false, nil
	case err != nil:
		return 0, false, fmt.Errorf("advance the fencing token of replication %s: %w", id, err)
	}
	return next, true, nil
}
