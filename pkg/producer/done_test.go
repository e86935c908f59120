package producer

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/publisher"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

func couchClient(t *testing.T, url string) *couch.Client {
	t.Helper()
	c, err := couch.New(couch.Config{URL: url}, nil)
	require.NoError(t, err)
	return c
}

// work is the work subject of g's job for db.
func work(g events.Group, db string) string { return events.NewSubjects("").Work(g, db) }

// A db changed since the previous sweep whose change a job has processed (its record equals
// its update_seq) gets no job from the sweep: no busy-work. A db whose record is older, or
// missing, gets one. The sweeps are called one by one here, so that the write and its
// processing fall between two of them.
func TestSweepSkipsDoneDBs(t *testing.T) {
	e := spiegeltest.New(t, spiegeltest.Options{Name: "pd", Install: true})
	ctx := t.Context()
	done, behind := e.Prefix+"done", e.Prefix+"behind"
	for _, db := range []string{done, behind} {
		e.Couch.CreateDB(t, db)
		e.Couch.Put(t, db, "d1", map[string]any{"x": 1})
	}
	set := rules.NewSet()
	_, err := set.Apply("rep", []byte(`{"type":"replicator","db_name":"^`+e.Prefix+`(done|behind)$","source":"$db_name","target":"`+e.Prefix+`all"}`), false)
	require.NoError(t, err)
	kv, err := natsjs.DoneBucket(t.Context(), e.JS, natsjs.DefaultTopology(""))
	require.NoError(t, err)
	records := reconcile.New(e.JS, kv)
	p := &producer{
		cfg:   producerSettings{SpiegelDB: e.SpiegelDB()},
		couch: couchClient(t, e.Couch.URL), rules: set, log: e.Logger(),
		done: &doneRecords{records: records, ensure: func(ctx context.Context) error {
			return natsjs.EnsureDoneBucket(ctx, e.JS, natsjs.DefaultTopology(""))
		}},
	}
	p.pub = publisher.New(natsjs.NewJobs(e.JS, events.NewSubjects("")), 64, nil, p.log)
	pubCtx, stopPub := context.WithCancel(ctx)
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); p.pub.Run(pubCtx, time.Second) }()
	t.Cleanup(func() { stopPub(); <-pubDone })
	sweep := func(prev map[string]string) map[string]string {
		snap, err := p.sweepOnce(ctx, prev)
		require.NoError(t, err)
		require.NoError(t, p.pub.Flush(ctx))
		return snap
	}
	// A consumer's run of each db: the recorder reads the update_seq, the handler succeeds.
	process := func(db string) {
		h := reconcile.NewRecorder(couchClient(t, e.Couch.URL), records, p.log).Wrap(func(context.Context, *worker.Job) error { return nil })
		require.NoError(t, h(ctx, &worker.Job{Group: events.GroupReplicate, DB: db}))
	}

	prev := sweep(nil)
	assert.Equal(t, map[string]uint64{work(events.GroupReplicate, done): 1, work(events.GroupReplicate, behind): 1}, e.Pending(t), "no record: both enqueued")
	// Swept again while the jobs are queued: refused, and no wakeup marker (which would cost
	// each db a second run after its first).
	prev = sweep(prev)
	jobs := natsjs.NewJobs(e.JS, events.NewSubjects(""))
	for _, db := range []string{done, behind} {
		marker, err := jobs.ReadWakeup(ctx, events.GroupReplicate, db)
		require.NoError(t, err)
		assert.Zero(t, marker, "a sweep's refused job leaves no wakeup marker for %s", db)
	}
	e.Purge(t) // both processed
	process(done)
	process(behind)

	prev = sweep(prev)
	assert.Empty(t, e.Pending(t), "both recorded done")

	// Both written; only done's change is processed before the next sweep.
	e.Couch.Put(t, done, "d2", map[string]any{"x": 2})
	e.Couch.Put(t, behind, "d2", map[string]any{"x": 2})
	process(done)
	prev = sweep(prev)
	assert.Equal(t, map[string]uint64{work(events.GroupReplicate, behind): 1}, e.Pending(t), "only the db whose change is unprocessed")

	// Both written again; behind's job succeeds after the sweep read the records and before it
	// enqueues (as the rules' catch-up jobs do while the first sweep after a start runs): only
	// done, still unprocessed, is enqueued.
	e.Purge(t)
	e.Couch.Put(t, done, "d3", map[string]any{"x": 3})
	e.Couch.Put(t, behind, "d3", map[string]any{"x": 3})
	p.done.records = &afterRead{doneReader: records, hook: func() { process(behind) }}
	sweep(prev)
	assert.Equal(t, map[string]uint64{work(events.GroupReplicate, done): 1}, e.Pending(t), "the db processed during the sweep is not run again")
}

// afterRead runs hook once, right after the records are read.
type afterRead struct {
	doneReader
	hook func()
}

func (a *afterRead) Read(ctx context.Context) (reconcile.Done, error) {
	d, err := a.doneReader.Read(ctx)
	if a.hook != nil {
		a.hook()
		a.hook = nil
	}
	return d, err
}
