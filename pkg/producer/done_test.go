package producer

import (
	"context"
	"slices"
	"sync"
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
	// A consumer's run of each db: the handler reads the feed to its end and vouches for it.
	cc := couchClient(t, e.Couch.URL)
	process := func(db string) {
		h := reconcile.NewRecorder(cc, records, p.log).Wrap(func(ctx context.Context, job *worker.Job) error {
			page, err := cc.Changes(ctx, job.DB, couch.ChangesOptions{})
			if err == nil {
				reconcile.Vouch(ctx, page.LastSeq)
			}
			return err
		})
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
		assert.Zero(t, marker.Seq, "a sweep's refused job leaves no wakeup marker for %s", db)
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

// recordingDropper records the dbs it is asked to drop.
type recordingDropper struct {
	mu      sync.Mutex
	dropped []string
}

func (d *recordingDropper) DropDB(_ context.Context, db string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dropped = append(d.dropped, db)
	return nil
}

func (d *recordingDropper) all() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.dropped)
}

// A db whose deleted event never reached the producer (a cluster node's _db_updates drops events
// while it is down) but that still has completion records is found by the sweep: CouchDB says it
// is gone, so its records and cached checkpoints are dropped, and a mirror rule's job deletes its
// keys. A db that exists but matches no rule any more loses its records (they serve nothing), not
// its checkpoints. A deleted event of a db of a mirror rule enqueues that job too; of a db of
// another on_change rule, none.
func TestSweepForgetsVanishedDBs(t *testing.T) {
	e := spiegeltest.New(t, spiegeltest.Options{Name: "pv", Install: true})
	ctx := t.Context()
	gone, unmatched, plain := e.Prefix+"m_gone", e.Prefix+"unmatched", e.Prefix+"p_gone"
	e.Couch.CreateDB(t, unmatched)
	set := rules.NewSet()
	_, err := set.Apply("mirror", []byte(`{"type":"on_change","db_name":"^`+e.Prefix+`m_","mirror":"PV_STATE"}`), false)
	require.NoError(t, err)
	_, err = set.Apply("hook", []byte(`{"type":"on_change","db_name":"^`+e.Prefix+`p_","url":"http://127.0.0.1:9/x"}`), false)
	require.NoError(t, err)
	kv, err := natsjs.DoneBucket(ctx, e.JS, natsjs.DefaultTopology(""))
	require.NoError(t, err)
	records := reconcile.New(e.JS, kv)
	for _, db := range []string{gone, unmatched, plain} {
		require.NoError(t, records.Put(ctx, events.GroupOnChange, db, "7-g1AAAA"))
	}
	undone, dropped := &recordingDropper{}, &recordingDropper{}
	p := &producer{
		cfg:   producerSettings{SpiegelDB: e.SpiegelDB()},
		couch: couchClient(t, e.Couch.URL), rules: set, log: e.Logger(),
		done: &doneRecords{records: records, ensure: func(context.Context) error { return nil }},
	}
	p.undone = newDeletedDBs(undone, producerMetrics{}, p.log)
	p.deleted = newDeletedDBs(dropped, producerMetrics{}, p.log)
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, d := range []*deletedDBs{p.undone, p.deleted} {
		wg.Add(1)
		go func() { defer wg.Done(); d.Run(runCtx) }()
	}
	p.pub = publisher.New(natsjs.NewJobs(e.JS, events.NewSubjects("")), 64, nil, p.log)
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); p.pub.Run(runCtx, time.Second) }()
	t.Cleanup(func() { stop(); <-pubDone; wg.Wait() })

	_, err = p.sweepOnce(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, p.pub.Flush(ctx))
	assert.Equal(t, map[string]uint64{work(events.GroupOnChange, gone): 1}, e.Pending(t), "the vanished db of the mirror rule gets the job that deletes its keys")
	require.Eventually(t, func() bool { return len(undone.all()) == 3 && len(dropped.all()) == 2 }, 10*time.Second, 20*time.Millisecond)
	assert.ElementsMatch(t, []string{gone, plain, unmatched}, undone.all(), "records of the vanished dbs dropped, and of the db no rule matches")
	assert.ElementsMatch(t, []string{gone, plain}, dropped.all(), "cached checkpoints of the vanished dbs dropped")

	// The deleted event itself: a job for the mirror rule's db, none for the other's.
	e.Purge(t)
	require.NoError(t, p.handle(ctx, couch.DBEvent{DB: gone, Type: couch.EventDeleted, Seq: "1"}))
	require.NoError(t, p.handle(ctx, couch.DBEvent{DB: plain, Type: couch.EventDeleted, Seq: "2"}))
	require.NoError(t, p.pub.Flush(ctx))
	assert.Equal(t, map[string]uint64{work(events.GroupOnChange, gone): 1}, e.Pending(t))
}

func TestSweepSpread(t *testing.T) {
	t.Parallel()
	assert.Equal(t, time.Minute, sweepSpread(10*time.Minute), "the default interval")
	assert.Equal(t, time.Minute, sweepSpread(time.Hour), "at most a minute")
	assert.Equal(t, 3*time.Second, sweepSpread(30*time.Second), "a tenth of a short interval")
}
