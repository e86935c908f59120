package main

import (
	"context"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

const (
	rep = events.GroupReplicate
	onc = events.GroupOnChange
)

// A burst of writes to one matched db leaves exactly one pending job per group; a db no rule
// matches gets none.
func TestBurstYieldsOneJobPerGroup(t *testing.T) {
	e := newEnv(t)
	hot, cold, marker := e.Prefix+"hot", e.Prefix+"cold", e.Prefix+"zmarker"
	for _, db := range []string{hot, cold, marker} {
		e.Couch.CreateDB(t, db)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "(hot|zmarker)$", "source": "$db_name", "target": e.Prefix + "target"})
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^" + e.Prefix + "(hot|zmarker)$", "url": "http://127.0.0.1:1/hook"})
	e.startProducer(t)
	// Jobs from the rules' initial enqueue; clear them so the burst alone is measured.
	e.waitJob(t, rep, hot, 20*time.Second)
	e.waitJob(t, onc, marker, 20*time.Second)
	e.Purge(t)

	e.writeDocs(t, hot, 1000, 8)
	e.writeDocs(t, cold, 50, 4)
	e.Couch.Put(t, marker, "m", map[string]any{"done": true})
	e.waitJob(t, onc, marker, 20*time.Second)
	e.waitJob(t, rep, marker, 20*time.Second)

	p := e.Pending(t)
	assert.Equal(t, uint64(1), p[work(rep, hot)])
	assert.Equal(t, uint64(1), p[work(onc, hot)])
	assert.Zero(t, p[work(rep, cold)])
	assert.Zero(t, p[work(onc, cold)])
	assert.Len(t, p, 4, "only hot and marker have jobs: %v", p)
}

// A new pattern rule enqueues every existing matching db; deleting it stops new jobs.
func TestPatternRuleEnqueuesExistingDBsAndDeleteStops(t *testing.T) {
	e := newEnv(t)
	var users []string
	for _, n := range []string{"u1", "u2", "u3", "u4", "u5"} {
		db := e.Prefix + "user_" + n
		e.Couch.CreateDB(t, db)
		e.Couch.Put(t, db, "d", map[string]any{"x": 1})
		users = append(users, db)
	}
	other := e.Prefix + "other"
	e.Couch.CreateDB(t, other)
	marker := e.Prefix + "marker"
	e.Couch.CreateDB(t, marker)
	e.putRule(t, "marker", map[string]any{"type": "replicator", "source": marker, "target": marker + "_copy"})
	e.startProducer(t)
	e.waitJob(t, rep, marker, 20*time.Second)

	rev := e.putRule(t, "users", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "user_", "source": "$db_name", "target": e.Prefix + "all"})
	for _, db := range users {
		e.waitJob(t, rep, db, 20*time.Second)
	}
	assert.Zero(t, e.Pending(t)[work(rep, other)])

	// Delete the rule with a plain DELETE (a tombstone without a body), wait until the producer
	// itself has dropped it (its status service: the rule feed is not the db-updates feed, so the
	// doc's deletion in CouchDB says nothing of when the producer sees it), then write.
	e.deleteDoc(t, e.cfg.DBName, "users", rev)
	require.Eventually(t, func() bool {
		for _, p := range e.statusJSON(t).Processes {
			if p.Component == status.ComponentProducer && p.Rules.Replicators == 1 {
				return true
			}
		}
		return false
	}, 20*time.Second, 100*time.Millisecond, "the producer still has the deleted rule")
	e.Purge(t)
	e.Couch.Put(t, users[0], "after", map[string]any{"x": 2})
	e.Couch.Put(t, marker, "after", map[string]any{"x": 2})
	e.waitJob(t, rep, marker, 20*time.Second)
	assert.Zero(t, e.Pending(t)[work(rep, users[0])], "deleted rule still enqueues")
}

// Every db name CouchDB allows flows from the feed to a job subject and back.
func TestSpecialDBNamesFlow(t *testing.T) {
	e := newEnv(t)
	name := e.Prefix + "a/b+c$d(e)-f_g"
	if e.Couch.PouchDB {
		// PouchDB Server cannot address a db whose name has '/' (it strips %2F from paths); the
		// full name is exercised against Apache CouchDB.
		name = e.Prefix + "ab+c$d(e)-f_g"
	}
	e.Couch.CreateDB(t, name)
	e.putRule(t, "exact", map[string]any{"type": "replicator", "source": "http://admin@couch.example:5984/" + escapePath(name), "target": e.Prefix + "copy"})
	e.startProducer(t)
	e.waitJob(t, rep, name, 20*time.Second)
	e.Purge(t)
	e.Couch.Put(t, name, "d", map[string]any{"x": 1})
	e.waitJob(t, rep, name, 20*time.Second)
	g, db, err := events.NewSubjects("").ParseWork(work(rep, name))
	require.NoError(t, err)
	assert.Equal(t, rep, g)
	assert.Equal(t, name, db)
}

func escapePath(s string) string {
	r := strings.NewReplacer("/", "%2F", "+", "%2B", "$", "%24", "(", "%28", ")", "%29")
	return r.Replace(s)
}

// Two producers at once still leave one pending job per (group, db).
func TestTwoProducers(t *testing.T) {
	e := newEnv(t)
	var dbs []string
	for _, n := range []string{"a", "b", "c", "d", "e", "f", "g", "h"} {
		db := e.Prefix + "two_" + n
		e.Couch.CreateDB(t, db)
		dbs = append(dbs, db)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "two_", "source": "$db_name", "target": e.Prefix + "all"})
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^" + e.Prefix + "two_", "url": "http://127.0.0.1:1/"})
	e.startProducer(t)
	e.startProducer(t)
	for _, db := range dbs {
		e.waitJob(t, rep, db, 20*time.Second)
		e.waitJob(t, onc, db, 20*time.Second)
	}
	e.Purge(t)
	var wg sync.WaitGroup
	for _, db := range dbs {
		wg.Add(1)
		go func() { defer wg.Done(); e.writeDocs(t, db, 20, 2) }()
	}
	wg.Wait()
	for _, db := range dbs {
		e.waitJob(t, rep, db, 20*time.Second)
		e.waitJob(t, onc, db, 20*time.Second)
	}
	p := e.Pending(t)
	assert.Len(t, p, 2*len(dbs))
	for subj, n := range p {
		assert.Equal(t, uint64(1), n, subj)
	}
}

// CouchDB unreachable for a while, then back: the producer notices within twice the feed
// heartbeat and catches up from its position without a restart (a write made meanwhile, which
// the feed announces, gets its job).
func TestCouchDBOutage(t *testing.T) {
	e := newEnv(t)
	proxy := e.Couch.NewProxy(t)
	e.cfg.CouchDBURL = proxy.URL(e.Couch.URL)
	e.cfg.CouchDBTimeout = 2 * time.Second
	db := e.Prefix + "out"
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	// Steady state first: a write seen through the feed after the first full round.
	e.Purge(t)
	e.Couch.Put(t, db, "before", map[string]any{"x": 0})
	e.waitJob(t, rep, db, 20*time.Second)
	e.Purge(t)

	proxy.Cut()
	require.Eventually(t, func() bool { return strings.Contains(e.Logs.String(), "db updates feed interrupted") },
		2*e.cfg.FeedHeartbeat, 20*time.Millisecond, "the producer did not notice the outage within twice the heartbeat")
	// CouchDB 3's _db_updates may announce "before" once more, late: what the feed read before
	// the cut is purged, so the job awaited below can only come from the write made while the
	// producer is cut off.
	e.Purge(t)
	e.Couch.Put(t, db, "while-down", map[string]any{"x": 1})
	assert.Zero(t, e.Pending(t)[work(rep, db)])
	proxy.Restore(t)
	e.waitJob(t, rep, db, 30*time.Second)
	require.Eventually(t, func() bool { return strings.Contains(e.Logs.String(), "db updates feed restored") }, 10*time.Second, 20*time.Millisecond)
}

// SIGTERM stops the producer process cleanly (exit 0) and saves its position: a position past
// the last write (the feed read from it has nothing of that db).
func TestProducerSIGTERMSavesPosition(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize()) // exact positions: see waitSettled
	db := e.Prefix + "term"
	mark := e.updatesMark(t)
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	cmd := e.startProcess(t, "SPIEGEL_POSITION_SAVE_INTERVAL=3s")
	e.waitJob(t, rep, db, 20*time.Second)
	e.waitSettled(t, db, mark)
	// A write seen through the feed; SIGTERM right after its job (usually before the next
	// periodic save, 3s) must still leave a saved position past it.
	e.Purge(t)
	mark = e.updatesMark(t)
	e.Couch.Put(t, db, "d", map[string]any{"x": 1})
	e.updates.Flush()
	require.Eventually(t, func() bool { return e.hasEventOf(t, db, mark) }, 20*time.Second, 20*time.Millisecond)
	e.waitJob(t, rep, db, 20*time.Second)
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		require.NoError(t, err, "producer exit status")
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("producer did not exit within 20s of SIGTERM")
	}
	pos := e.position(t)
	assert.Equal(t, "db_updates", pos.Source)
	assert.False(t, e.hasEventOf(t, db, pos.LastSeq), "the saved position is past the write")
	assert.NotEmpty(t, pos.RulesSeq)
}

// A producer started before install exits with a message that says to run install.
func TestProducerBeforeInstall(t *testing.T) {
	e := newEnv(t)
	var stderr strings.Builder
	t.Setenv("SPIEGEL_COUCHDB_URL", e.Couch.URL)
	t.Setenv("SPIEGEL_DB_NAME", e.Prefix+"never_installed")
	t.Setenv("SPIEGEL_NATS_URL", e.cfg.NATSURL)
	t.Setenv("SPIEGEL_SUBJECT_PREFIX", "other")
	t.Setenv("SPIEGEL_HTTP_ADDR", "")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	code := realMain(ctx, nil, strings.NewReader(""), &strings.Builder{}, &stderr)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr.String(), "producer install")
}
