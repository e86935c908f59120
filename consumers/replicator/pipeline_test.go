package main

import (
	"fmt"
	"net/http"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// These tests run the real producer binary (polling every 200ms) with the replicator, so jobs
// come from writes, as in production.

// A pattern rule serves many dbs: after the pipeline settles, writes to 10 of 50 user dbs are
// all replicated into one target, and the 40 idle dbs get no job.
func TestPatternRuleReplicatesOnlyWrittenDBs(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	target := e.Prefix + "all_posts"
	e.Couch.CreateDB(t, target)
	var users []string
	for i := range 50 {
		db := fmt.Sprintf("%suser_%02d", e.Prefix, i)
		e.Couch.CreateDB(t, db)
		users = append(users, db)
	}
	marker := e.Prefix + "zz_marker"
	e.Couch.CreateDB(t, marker)
	e.Couch.Put(t, e.cfg.DBName, "users", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "user_", "source": "$db_name", "target": target})
	e.Couch.Put(t, e.cfg.DBName, "marker", map[string]any{"type": "replicator", "source": marker, "target": marker + "_copy", "create_target": true})
	p := e.startReplicator(t, nil)
	e.startProducer(t)
	// The new rules enqueue every matching db once: wait for those jobs to run.
	require.Eventually(t, func() bool { return len(p.jobDBs()) == 51 }, 60*time.Second, 50*time.Millisecond)
	e.waitQuiet(t, p, 60*time.Second)
	p.reset()

	written := map[string]bool{}
	for i := 0; i < 50; i += 5 {
		db := users[i]
		written[db] = true
		e.Couch.Put(t, db, db+"_post", map[string]any{"by": db})
	}
	require.Eventually(t, func() bool { return len(revs(t, e.Couch, target)) == 10 }, 30*time.Second, 100*time.Millisecond)
	// A write after all the others: once its job ran, a job for an idle db, whose event could
	// only have come with or before the marker's, would have been enqueued too.
	e.Couch.Put(t, marker, "m", map[string]any{"last": true})
	require.Eventually(t, func() bool { return p.jobCount(marker) > 0 }, 30*time.Second, 50*time.Millisecond)
	e.waitQuiet(t, p, 30*time.Second)
	got := p.jobDBs()
	for db := range written {
		assert.GreaterOrEqual(t, got[db], 1, "no job for written db %s", db)
	}
	for db, n := range got {
		assert.True(t, written[db] || db == marker, "idle db %s got %d job(s)", db, n)
	}
	got10 := revs(t, e.Couch, target)
	for db := range written {
		assert.Contains(t, got10, db+"_post")
	}
}

// A burst of 1,000 writes to one db runs far fewer than 100 replications, and the target ends
// with the source's docs and revs.
func TestBurstCollapsesReplications(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	src, tgt := e.Prefix+"hot", e.Prefix+"hot_copy"
	e.Couch.CreateDB(t, src)
	e.Couch.CreateDB(t, tgt)
	e.Couch.Put(t, e.cfg.DBName, "hot", map[string]any{"type": "replicator", "source": src, "target": tgt})
	p := e.startReplicator(t, nil)
	e.startProducer(t)
	require.Eventually(t, func() bool { return p.jobCount(src) > 0 }, 30*time.Second, 50*time.Millisecond, "the new rule's job")
	e.waitQuiet(t, p, 30*time.Second)
	p.reset()

	writeDocs(t, e, src, 1000, 8)
	waitConverged(t, e.Couch, src, tgt, 60*time.Second)
	e.waitQuiet(t, p, 30*time.Second)
	waitConverged(t, e.Couch, src, tgt, 10*time.Second)
	n := len(p.replications(src))
	t.Logf("1,000 writes → %d replications", n)
	assert.GreaterOrEqual(t, n, 1)
	assert.Less(t, n, 100)
	assert.Len(t, revs(t, e.Couch, tgt), 1000)
}

// dirty_after_milliseconds: 10000 turns 50 writes into exactly one replication, started after the
// last write landed and no earlier than the delay after the first. (The delay is long so that
// the writes, about 0.1s on a quiet machine and several seconds on a loaded one, fit in it.)
func TestDirtyAfterAbsorbsBurst(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	src, tgt := e.Prefix+"lazy", e.Prefix+"lazy_copy"
	e.Couch.CreateDB(t, src)
	e.Couch.CreateDB(t, tgt)
	e.Couch.Put(t, e.cfg.DBName, "lazy", map[string]any{"type": "replicator", "source": src, "target": tgt, "dirty_after_milliseconds": 10000})
	p := e.startReplicator(t, nil)
	e.startProducer(t)
	require.Eventually(t, func() bool { return len(p.replications(src)) > 0 }, 30*time.Second, 50*time.Millisecond, "the new rule's replication")
	e.waitQuiet(t, p, 30*time.Second)
	p.reset()

	first := time.Now()
	writeDocs(t, e, src, 50, 4)
	last := time.Now()
	waitConverged(t, e.Couch, src, tgt, 40*time.Second)
	e.waitQuiet(t, p, 20*time.Second)
	reps := p.replications(src)
	require.NotEmpty(t, reps)
	// The premise, as an order rather than a duration: every write landed before the delayed
	// run started.
	require.True(t, last.Before(reps[0]), "a write landed after the delayed replication started: the premise failed")
	assert.Len(t, reps, 1, "exactly one replication")
	assert.GreaterOrEqual(t, reps[0].Sub(first), 10*time.Second, "not before the delay")
}

// A deleted source db is not retried in a loop; once recreated and written, it replicates again.
func TestDeletedSourceNoLoopThenResumes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	src, tgt := e.Prefix+"gone", e.Prefix+"gone_copy"
	e.Couch.CreateDB(t, src)
	e.Couch.CreateDB(t, tgt)
	e.Couch.Put(t, src, "before", map[string]any{"x": 1})
	e.Couch.Put(t, e.cfg.DBName, "gone", map[string]any{"type": "replicator", "source": src, "target": tgt})
	p := e.startReplicator(t, nil)
	e.startProducer(t)
	waitConverged(t, e.Couch, src, tgt, 30*time.Second)
	e.waitQuiet(t, p, 30*time.Second)
	p.reset()

	require.NoError(t, e.Couch.Do(t, http.MethodDelete, "/"+escapeDBName(src), nil, nil))
	e.publish(t, src) // as the producer does for a deleted db, in case it did not see it
	time.Sleep(8 * time.Second)
	jobs := p.jobCount(src)
	t.Logf("jobs for the deleted db in 8s: %d, attempts %v", jobs, p.attemptsOf(src))
	assert.GreaterOrEqual(t, jobs, 1)
	// The test's job, the deletion's own (unless a hot feed covered it), the hot feed's, which
	// ends with the db and publishes once more for an event it passed over, and one for a wakeup
	// marker when one of those was refused while another ran (the lost-wakeup rule): at most 4,
	// each a first delivery (a loop would retry).
	assert.LessOrEqual(t, jobs, 4, "a missing source must not loop")
	for _, a := range p.attemptsOf(src) {
		assert.Equal(t, 1, a, "a missing source is not retried")
	}
	assert.Empty(t, p.replications(src), "no _replicate for a missing source (PouchDB would recreate it)")
	assert.Equal(t, uint64(0), e.WorkMsgs(t))
	assert.Contains(t, e.Logs.String(), "source db does not exist")

	e.Couch.CreateDB(t, src)
	e.Couch.Put(t, src, "after", map[string]any{"x": 2})
	require.Eventually(t, func() bool { _, ok := revs(t, e.Couch, tgt)["after"]; return ok }, 30*time.Second, 100*time.Millisecond)
}

// writeDocs writes n docs to db with `workers` parallel writers.
func writeDocs(t *testing.T, e *env, db string, n, workers int) {
	t.Helper()
	var wg sync.WaitGroup
	ch := make(chan int)
	var mu sync.Mutex
	var errs []string
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range ch {
				if err := e.Couch.Do(t, http.MethodPut, fmt.Sprintf("/%s/doc%05d", escapeDBName(db), i), map[string]any{"n": i}, nil); err != nil {
					mu.Lock()
					errs = append(errs, err.Error())
					mu.Unlock()
				}
			}
		}()
	}
	for i := range n {
		ch <- i
	}
	close(ch)
	wg.Wait()
	sort.Strings(errs)
	require.Empty(t, errs)
}
