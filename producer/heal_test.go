package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// The reconciliation sweep heals from CouchDB what NATS lost (SPEC §3, §7.7). A consumer here is
// the shared worker runner with the completion recorder around a handler that counts its runs
// and reads the db's feed to its end (vouching for it), as the consumer binaries wrap theirs
// (pkg/consumer).

// runs counts the jobs a test consumer ran, by db and reason.
type runs struct {
	mu  sync.Mutex
	got map[string][]string // db → reasons, in run order
}

func (r *runs) of(db string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.got[db]...)
}

// startConsumer runs jobs of g until the returned stop is called (also at the end of the test).
func (e *env) startConsumer(t *testing.T, g events.Group) (*runs, func()) {
	t.Helper()
	r := &runs{got: map[string][]string{}}
	records := e.records(t)
	cc := couchClient(t, e.cfg.CouchDBURL)
	rec := reconcile.NewRecorder(cc, records, e.Logger())
	// As the consumers do: records vouch for the rules they ran with.
	set := rules.NewSet()
	rf := &rulefeed.Follower{Couch: cc, DB: e.cfg.DBName, Set: set, Log: e.Logger()}
	from, err := rf.Load(t.Context())
	require.NoError(t, err)
	rec.Rules = set.Fingerprint
	h := rec.Wrap(func(ctx context.Context, job *worker.Job) error {
		r.mu.Lock()
		r.got[job.DB] = append(r.got[job.DB], job.Reason)
		r.mu.Unlock()
		// As the consumers do: read the db's feed to its end, and vouch for where it ended.
		page, err := cc.Changes(ctx, job.DB, couch.ChangesOptions{})
		if errors.Is(err, couch.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		reconcile.Vouch(ctx, page.LastSeq)
		return nil
	})
	runner, err := worker.New(e.JS, events.NewSubjects(""), worker.Config{Group: g, Concurrency: 4}, h, e.Logger())
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go rf.Follow(ctx, from)
	go func() { defer close(done); _ = runner.Run(ctx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return r, stop
}

// records opens the installation's completion records.
func (e *env) records(t *testing.T) *reconcile.Records {
	t.Helper()
	kv, err := natsjs.DoneBucket(t.Context(), e.JS, natsjs.DefaultTopology(""))
	require.NoError(t, err)
	return reconcile.New(e.JS, kv)
}

// sweeps returns how many sweeps have asked for the dbs' update_seqs so far. Sweeps run one
// after another: once the count is n+2, the sweep counted n+1 has finished, and it started
// after the count was n.
func (e *env) sweeps() int { return e.updates.Requests(http.MethodPost, "/_dbs_info") }

// waitSweeps waits until n more sweeps started and the one before the last has finished.
func (e *env) waitSweeps(t *testing.T, n int) {
	t.Helper()
	from := e.sweeps()
	require.Eventually(t, func() bool { return e.sweeps() >= from+n+1 }, 30*time.Second, 20*time.Millisecond,
		"%d sweeps did not run", n)
}

// waitDone waits until the completion record of (g, db) covers the db's update_seq, as the
// sweep asks of it: the same string, or no change in CouchDB after the record's seq.
func (e *env) waitDone(t *testing.T, g events.Group, db string) {
	t.Helper()
	records := e.records(t)
	cc := couchClient(t, e.direct.URL)
	require.Eventually(t, func() bool {
		info, err := cc.DBInfo(t.Context(), db)
		require.NoError(t, err)
		done, err := records.Read(t.Context())
		require.NoError(t, err)
		rec, ok := done[reconcile.Key(g, db)]
		if !ok || reconcile.Covered(rec, info.UpdateSeq) {
			return ok
		}
		seq, _ := reconcile.ParseValue(rec)
		changed, err := cc.ChangedSince(t.Context(), db, seq)
		return err == nil && !changed
	}, 30*time.Second, 50*time.Millisecond, "%s never recorded done at the update_seq of %s", g, db)
}

// replicatedDB creates db <prefix><name> with one doc and a replicator rule for it, and returns
// it with the _db_updates mark taken before its creation.
func (e *env) replicatedDB(t *testing.T, name string) (string, string) {
	t.Helper()
	db := e.Prefix + name
	mark := e.updatesMark(t)
	e.Couch.CreateDB(t, db)
	e.Couch.Put(t, db, "d", map[string]any{"x": 1})
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	return db, mark
}

// A job JetStream acknowledged and then lost (the work stream purged, as a store rolled back
// after a power failure leaves it) is enqueued again by the next sweep, although the db did
// not change: no completion record says it was processed.
func TestSweepHealsLostJob(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	db, mark := e.replicatedDB(t, "lost")
	e.cfg.SweepInterval = 300 * time.Millisecond
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	e.waitSettled(t, db, mark)
	e.waitRulesCaughtUp(t)
	// Two sweeps that started after the db's last write: one comparing the update_seq with the
	// previous sweep's would have enqueued it by now, and never again.
	e.waitSweeps(t, 2)
	e.Purge(t)
	e.waitJob(t, rep, db, 20*time.Second)
	assert.Equal(t, events.ReasonSweep, e.jobReason(t, rep, db), "the job came from the sweep")
}

// A rule added for a db that its group's record says is done: the rule's catch-up job is
// enqueued and then lost (the work stream purged) before any consumer ran it. The db did not
// change, but its record vouches for the rules before the new one, so the sweep enqueues it
// again, and the new rule acts on the db's existing docs (SPEC §7.9). Before records named
// their rules, the record covered the db's update_seq and the rule skipped the db until its
// next write.
func TestSweepHealsALostRuleCatchUp(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	db, mark := e.replicatedDB(t, "newrule")
	e.cfg.SweepInterval = 300 * time.Millisecond
	e.startProducer(t)
	_, stop := e.startConsumer(t, rep)
	e.waitSettled(t, db, mark)
	e.waitDone(t, rep, db)
	e.waitRulesCaughtUp(t)
	stop()
	e.waitSweeps(t, 2)
	require.Empty(t, e.Pending(t), "settled: no job")

	before := e.position(t).RulesSeq
	e.putRule(t, "rep2", map[string]any{"type": "replicator", "source": db, "target": db + "_other"})
	e.waitJob(t, rep, db, 20*time.Second) // the catch-up's, or a sweep's that saw the new rule first
	// The rules' position moves past a rule only once its catch-up's publishes are acknowledged.
	require.Eventually(t, func() bool { return e.position(t).RulesSeq != before }, 20*time.Second, 20*time.Millisecond,
		"the new rule's catch-up is done")
	e.Purge(t) // lost
	e.waitJob(t, rep, db, 20*time.Second)
	assert.Equal(t, events.ReasonSweep, e.jobReason(t, rep, db), "the sweep enqueued the db again for the new rule")
}

// The same right after a restart: the producer's first sweep heals a job lost while it was down
// (with a sweep interval far beyond the test, only the first sweep can).
func TestFirstSweepAfterRestartHealsLostJob(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	db, mark := e.replicatedDB(t, "lost")
	e.cfg.SweepInterval = time.Hour
	stop := e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	e.waitSettled(t, db, mark)
	e.waitRulesCaughtUp(t)
	stop()
	e.Purge(t)
	require.Empty(t, e.Pending(t))
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	assert.Equal(t, events.ReasonSweep, e.jobReason(t, rep, db), "the job came from the sweep")
}

// With every job processed, the sweeps enqueue nothing; once the completion records are lost
// (their bucket's stream purged), the next sweep enqueues every matched db, each runs, records
// again, and the sweeps are quiet again: nothing lost, no job without end.
func TestSweepAfterRecordsLost(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	dbs := []string{e.Prefix + "rec_a", e.Prefix + "rec_b", e.Prefix + "rec_c"}
	for _, db := range dbs {
		e.Couch.CreateDB(t, db)
		e.Couch.Put(t, db, "d", map[string]any{"x": 1})
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "rec_", "source": "$db_name", "target": e.Prefix + "all"})
	e.cfg.SweepInterval = 300 * time.Millisecond
	e.startProducer(t)
	got, _ := e.startConsumer(t, rep)
	for _, db := range dbs {
		e.waitDone(t, rep, db)
	}
	// Settled: sweeps find every db done.
	before := e.assertQuiet(t, got, dbs, "ran although it was done")

	s, err := e.JS.Stream(t.Context(), "KV_SPIEGEL_DONE")
	require.NoError(t, err)
	require.NoError(t, s.Purge(t.Context()))
	for _, db := range dbs {
		require.Eventually(t, func() bool { return len(got.of(db)) > before[db] }, 20*time.Second, 20*time.Millisecond,
			"%s never ran after the records were lost", db)
		assert.Equal(t, events.ReasonSweep, got.of(db)[before[db]])
		e.waitDone(t, rep, db)
	}
	// And quiet again.
	e.assertQuiet(t, got, dbs, "kept running after its record was back")
}

// assertQuiet waits until no job is pending and a sweep has finished, then asserts that three
// more sweeps run no job of dbs; it returns each db's count of runs before them.
func (e *env) assertQuiet(t *testing.T, got *runs, dbs []string, what string) map[string]int {
	t.Helper()
	require.Eventually(t, func() bool { return len(e.Pending(t)) == 0 }, 20*time.Second, 20*time.Millisecond)
	e.waitSweeps(t, 1)
	runs := map[string]int{}
	for _, db := range dbs {
		runs[db] = len(got.of(db))
	}
	e.waitSweeps(t, 3)
	for _, db := range dbs {
		assert.Len(t, got.of(db), runs[db], "%s %s", db, what)
	}
	return runs
}

// A deleted db's completion records, of every group, are purged (a db recreated under its name
// must not match its predecessor's record: PouchDB Server's seqs start over); other dbs' stay.
func TestDeletedDBDropsRecords(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	gone, stays := e.Prefix+"gone", e.Prefix+"stays"
	e.Couch.CreateDB(t, gone)
	e.Couch.CreateDB(t, stays)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "(gone|stays)$", "source": "$db_name", "target": e.Prefix + "all"})
	records := e.records(t)
	for _, k := range []struct {
		g  events.Group
		db string
	}{{rep, gone}, {onc, gone}, {rep, stays}} {
		require.NoError(t, records.Put(t.Context(), k.g, k.db, "1"))
	}
	e.startProducer(t)
	e.waitRulesCaughtUp(t)
	require.NoError(t, e.Couch.Do(t, http.MethodDelete, "/"+couchtest.PathDB(gone), nil, nil))
	e.updates.Flush()
	require.Eventually(t, func() bool {
		done, err := records.Read(t.Context())
		if err != nil { // a read that a write interrupts, on a loaded machine: read again
			return false
		}
		_, a := done[reconcile.Key(rep, gone)]
		_, b := done[reconcile.Key(onc, gone)]
		return !a && !b
	}, 20*time.Second, 20*time.Millisecond, "the deleted db's records were never dropped")
	done, err := records.Read(t.Context())
	require.NoError(t, err)
	assert.Equal(t, "1", done[reconcile.Key(rep, stays)], "another db's record stays")
}

// NATS restarted from a copy of its store taken before a job was stored — what a power failure
// with lazy fsync leaves — lost a job it had acknowledged (and the consumer state and records
// with it): the sweep heals it from CouchDB, and the job runs.
func TestSweepHealsStoreRollback(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	db := e.Prefix + "rollback"
	e.Couch.CreateDB(t, db)
	e.Couch.Put(t, db, "d1", map[string]any{"x": 1})
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.cfg.SweepInterval = 300 * time.Millisecond
	e.startProducer(t)
	_, stopConsumer := e.startConsumer(t, rep)
	e.waitDone(t, rep, db)
	require.Eventually(t, func() bool { return len(e.Pending(t)) == 0 }, 20*time.Second, 20*time.Millisecond)
	e.waitRulesCaughtUp(t)
	stopConsumer()

	// The copy of the store, taken while NATS is down.
	saved := e.copyStore(t)

	// A write whose job JetStream acknowledges, and sweeps that find it pending.
	mark := e.updatesMark(t)
	e.Couch.Put(t, db, "d2", map[string]any{"x": 2})
	e.waitJob(t, rep, db, 30*time.Second)
	e.waitSettled(t, db, mark)
	e.waitSweeps(t, 2)

	// The power failure: the store comes back as the copy has it, without the job.
	e.restoreStore(t, saved)

	got, _ := e.startConsumer(t, rep)
	require.Eventually(t, func() bool { return slices.Contains(got.of(db), events.ReasonSweep) }, 30*time.Second, 20*time.Millisecond,
		"the job lost with the store never ran")
	e.waitDone(t, rep, db)
}

// Our changes stream loses messages it had acknowledged — NATS restarted from an older copy of
// its store — after every job of the db was recorded done, so no completion record is behind.
// The sweep notices the stream going back and enqueues the db's on_change job (its subject rule
// then publishes again, after what the stream holds, what it had stored there: see
// consumers/onchange checkStream); without the stream watch the db would get no job until its
// next write.
func TestSweepEnqueuesSubjectRulesAfterChangeStreamLoss(t *testing.T) {
	e, db := settledOnChangeDB(t, "streamloss", map[string]any{"subject": "spiegel.changes.${db_name}"})
	publish := func(n int) { // what the subject rule published, as far as the stream is concerned
		for i := range n {
			_, err := e.JS.Publish(t.Context(), "spiegel.changes.x", []byte(fmt.Sprint(i)))
			require.NoError(t, err)
		}
	}
	publish(1)
	e.waitSweeps(t, 2)

	// The copy of the store, taken while NATS is down; then messages the copy does not hold,
	// which the sweeps see.
	saved := e.copyStore(t)
	e.settleRestart(t)
	publish(2)
	e.waitSweeps(t, 3)
	assert.Empty(t, e.Pending(t), "no loss seen while the stream only grew: no job")

	// The power failure: the store comes back as the copy has it.
	e.restoreStore(t, saved)

	got, _ := e.startConsumer(t, onc)
	require.Eventually(t, func() bool { return slices.Contains(got.of(db), events.ReasonSweep) }, 30*time.Second, 20*time.Millisecond,
		"the db's on_change job after the changes stream lost messages")
	assertBystanderQuiet(t, e, got, db)
}

// copyStore stops NATS, copies its store and starts it again: the copy a power failure with lazy
// sync leaves behind.
func (e *env) copyStore(t *testing.T) string {
	t.Helper()
	store, saved := e.NATS.StoreDir(), filepath.Join(t.TempDir(), "store") // the dir is known while NATS runs
	e.NATS.Stop()
	require.NoError(t, os.CopyFS(saved, os.DirFS(store)))
	e.NATS.StartAgain(t)
	return saved
}

// settleRestart waits, after a NATS restart, until the sweeps have looked at the restarted
// stream and nothing is pending: a restart that loses nothing gives no job.
func (e *env) settleRestart(t *testing.T) {
	t.Helper()
	e.waitSweeps(t, 2)
	e.waitSweeps(t, 1)
	require.Empty(t, e.Pending(t), "a restart that lost nothing gives no job")
}

// restoreStore plays the power failure: NATS comes back with the store as saved has it.
func (e *env) restoreStore(t *testing.T, saved string) {
	t.Helper()
	store := e.NATS.StoreDir()
	e.NATS.Stop()
	require.NoError(t, os.RemoveAll(store))
	require.NoError(t, os.CopyFS(store, os.DirFS(saved)))
	e.NATS.StartAgain(t)
}

// Our changes stream comes back with a message missing in the middle (made here by removing one)
// after every job of the db was recorded done. The stream's last message is the same, so only its
// gaps tell: the sweep enqueues the db's on_change job, whose subject rule checks its subject
// and reports what it lacks (consumers/onchange checkStream). The producer deletes nothing.
func TestSweepEnqueuesSubjectRulesAfterAGapInTheChangesStream(t *testing.T) {
	e, db := settledOnChangeDB(t, "streamhole", map[string]any{"subject": "spiegel.changes.${db_name}"})
	var seqs []uint64
	for i := range 3 {
		ack, err := e.JS.Publish(t.Context(), "spiegel.changes.x", []byte(fmt.Sprint(i)))
		require.NoError(t, err)
		seqs = append(seqs, ack.Sequence)
	}
	e.waitSweeps(t, 2)
	assert.Empty(t, e.Pending(t), "no loss seen while the stream only grew: no job")

	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	require.NoError(t, stream.DeleteMsg(t.Context(), seqs[1]))

	got, _ := e.startConsumer(t, onc)
	require.Eventually(t, func() bool { return slices.Contains(got.of(db), events.ReasonSweep) }, 30*time.Second, 20*time.Millisecond,
		"the db's on_change job after a gap in the changes stream")
	e.waitDone(t, onc, db)
	assertBystanderQuiet(t, e, got, db)
	info, err := stream.Info(t.Context())
	require.NoError(t, err)
	assert.Equal(t, seqs[2], info.State.LastSeq, "nothing published or deleted by the producer")
	assert.Equal(t, 1, info.State.NumDeleted, "the one message removed by the test")
}

// settledOnChangeDB starts a producer and a consumer for one new db matched by an on_change rule
// with action (subject or mirror), waits until its job is done and nothing is pending, and stops
// the consumer: a db whose completion records are current, which no sweep enqueues by itself.
// Beside it, settled the same way, is bystander(db), matched by a webhook rule only: a loss in
// NATS is none of its business.
func settledOnChangeDB(t *testing.T, name string, action map[string]any) (*env, string) {
	e, db, _ := settledOnChangeDBWithStop(t, name, action)
	return e, db
}

// bystander is the webhook-only db settledOnChangeDB makes beside db.
func bystander(db string) string { return db + "_hook" }

// assertBystanderQuiet checks, after a loss enqueued db, that the sweeps gave bystander(db) no job:
// the sweep that enqueued db's check would have enqueued it too, right after db. Two sweeps later
// that job would be run or pending.
func assertBystanderQuiet(t *testing.T, e *env, got *runs, db string) {
	t.Helper()
	e.waitSweeps(t, 2)
	assert.NotContains(t, got.of(bystander(db)), events.ReasonSweep,
		"the db of a webhook rule only got a job for a loss in NATS, where its rule writes nothing")
	assert.NotContains(t, e.Pending(t), work(onc, bystander(db)), "the webhook-only db has a job pending")
}

// settledOnChangeDBWithStop is settledOnChangeDB that returns the producer's stop too.
func settledOnChangeDBWithStop(t *testing.T, name string, action map[string]any) (*env, string, func()) {
	t.Helper()
	e := newEnv(t, couchtest.AlwaysSynthesize())
	db := e.Prefix + name
	e.Couch.CreateDB(t, db)
	e.Couch.Put(t, db, "d1", map[string]any{"x": 1})
	rule := map[string]any{"type": "on_change", "db_name": "^" + db + "$"}
	maps.Copy(rule, action)
	e.putRule(t, "rule", rule)
	hooked := bystander(db)
	e.Couch.CreateDB(t, hooked)
	e.Couch.Put(t, hooked, "d1", map[string]any{"x": 1})
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^" + hooked + "$", "url": "https://hooks.example.com/spiegel"})
	e.cfg.SweepInterval = 300 * time.Millisecond
	stopProducer := e.startProducer(t)
	_, stopConsumer := e.startConsumer(t, onc)
	e.waitDone(t, onc, db)
	e.waitDone(t, onc, hooked)
	require.Eventually(t, func() bool { return len(e.Pending(t)) == 0 }, 20*time.Second, 20*time.Millisecond)
	e.waitRulesCaughtUp(t)
	stopConsumer()
	return e, db, stopProducer
}
