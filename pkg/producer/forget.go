package producer

import (
	"context"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// dbDropper drops the cached checkpoints of one db (*checkpoint.CacheDropper).
type dbDropper interface {
	DropDB(ctx context.Context, db string) error
}

// deletedDBs drops the cached on_change checkpoints of deleted dbs off the feed's path: the feed
// hands it a db (Add never blocks, nor waits for NATS) and one goroutine (Run) drops each with
// one request, retrying while NATS fails. Best effort: a consumer that finds a cached checkpoint
// of a db gone reads CouchDB (checkpoint.OnChangeStore). Its memory is the dbs not dropped yet,
// given back once none is left.
type deletedDBs struct {
	drop    dbDropper
	log     logrus.FieldLogger
	metrics producerMetrics
	timeout time.Duration // of one drop

	mu      sync.Mutex
	pending map[string]int // db → failed attempts so far
	wake    chan struct{}
}

func newDeletedDBs(d dbDropper, m producerMetrics, log logrus.FieldLogger) *deletedDBs {
	return &deletedDBs{drop: d, log: log, metrics: m, timeout: 5 * time.Second, pending: map[string]int{}, wake: make(chan struct{}, 1)}
}

// Add asks for db's cached checkpoints to be dropped.
func (d *deletedDBs) Add(db string) {
	if d == nil {
		return
	}
	d.mu.Lock()
	if _, ok := d.pending[db]; !ok {
		d.pending[db] = 0
	}
	d.mu.Unlock()
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// Pending returns the number of dbs not dropped yet.
func (d *deletedDBs) Pending() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.pending)
}

// Run drops what Add hands in until ctx ends.
func (d *deletedDBs) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		}
		for d.dropAll(ctx) {
		}
	}
}

// dropAll tries each pending db once; it reports whether some are left to retry (after a
// backoff delay, which it waits).
func (d *deletedDBs) dropAll(ctx context.Context) bool {
	d.mu.Lock()
	dbs := make([]string, 0, len(d.pending))
	for db := range d.pending {
		dbs = append(dbs, db)
	}
	d.mu.Unlock()
	attempt := 0
	for _, db := range dbs {
		dctx, cancel := context.WithTimeout(ctx, d.timeout)
		err := d.drop.DropDB(dctx, db)
		cancel()
		if ctx.Err() != nil {
			return false
		}
		d.mu.Lock()
		if err == nil {
			delete(d.pending, db)
			if len(d.pending) == 0 {
				// A map keeps the room of its biggest size: a fresh one gives back what a burst
				// of deletes took.
				d.pending = map[string]int{}
			}
		} else {
			d.pending[db]++
			attempt = max(attempt, d.pending[db])
		}
		d.mu.Unlock()
		if err == nil {
			d.metrics.checkpointsDropped()
		} else if attempt == 1 {
			d.log.WithError(err).WithField("db", db).Warn("drop the cached on_change checkpoints of a deleted db: retrying")
		}
	}
	if attempt == 0 {
		d.mu.Lock()
		left := len(d.pending) > 0
		d.mu.Unlock()
		return left
	}
	return backoff.Sleep(ctx, backoff.Default.Delay(attempt)) == nil
}

// ruleDropper drops what one rule keeps in the checkpoint bucket (*checkpoint.CacheDropper).
type ruleDropper interface {
	DropRule(ctx context.Context, rule string) error
}

// ruleDrops hands rule ids to a deletedDBs queue: its DropDB drops a rule.
type ruleDrops struct{ d ruleDropper }

func (r ruleDrops) DropDB(ctx context.Context, rule string) error { return r.d.DropRule(ctx, rule) }

// ruleRemoved is the rule feed's OnRemoved: a rule deleted (or invalid now) leaves its cached
// on_change checkpoints and its native replications' fencing tokens in the bucket, one per db;
// a replicator rule edited may change its replications' ids, which leaves the old tokens. They
// are dropped off the feed's path (removedRules). An on_change rule edited keeps its entries:
// they stay its checkpoints.
func (p *producer) ruleRemoved(old, now rules.Rule) {
	if now == nil || old.Kind() == rules.KindReplicator {
		p.removedRules.Add(old.ID())
	}
}
