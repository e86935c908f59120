package main

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

const (
	rep = events.GroupReplicate
	onc = events.GroupOnChange
)

// A burst of writes to one matched db leaves exactly one pending job per group; a db no rule
// matches gets none.
func TestBurstYieldsOneJobPerGroup(t *testing.T) {
	e := newEnv(t)
	hot, cold, marker := e.prefix+"hot", e.prefix+"cold", e.prefix+"zmarker"
	for _, db := range []string{hot, cold, marker} {
		e.couch.CreateDB(t, db)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.prefix + "(hot|zmarker)$", "source": "$db_name", "target": e.prefix + "target"})
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^" + e.prefix + "(hot|zmarker)$", "url": "http://127.0.0.1:1/hook"})
	e.startProducer(t)
	// Jobs from the rules' initial enqueue; clear them so the burst alone is measured.
	e.waitJob(t, rep, hot, 20*time.Second)
	e.waitJob(t, onc, marker, 20*time.Second)
	e.purge(t)

	e.writeDocs(t, hot, 1000, 8)
	e.writeDocs(t, cold, 50, 4)
	e.couch.Put(t, marker, "m", map[string]any{"done": true})
	e.waitJob(t, onc, marker, 20*time.Second)
	e.waitJob(t, rep, marker, 20*time.Second)

	p := e.pending(t)
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
		db := e.prefix + "user_" + n
		e.couch.CreateDB(t, db)
		e.couch.Put(t, db, "d", map[string]any{"x": 1})
		users = append(users, db)
	}
	other := e.prefix + "other"
	e.couch.CreateDB(t, other)
	marker := e.prefix + "marker"
	e.couch.CreateDB(t, marker)
	e.putRule(t, "marker", map[string]any{"type": "replicator", "source": marker, "target": marker + "_copy"})
	e.startProducer(t)
	e.waitJob(t, rep, marker, 20*time.Second)

	rev := e.putRule(t, "users", map[string]any{"type": "replicator", "db_name": "^" + e.prefix + "user_", "source": "$db_name", "target": e.prefix + "all"})
	for _, db := range users {
		e.waitJob(t, rep, db, 20*time.Second)
	}
	assert.Zero(t, e.pending(t)[work(rep, other)])

	// Delete the rule with a plain DELETE (a tombstone without a body), then write.
	e.deleteDoc(t, e.cfg.DBName, "users", rev)
	e.purge(t)
	require.Eventually(t, func() bool {
		_, ok := ruleStillLoaded(t, e, "users")
		return !ok
	}, 20*time.Second, 100*time.Millisecond)
	e.couch.Put(t, users[0], "after", map[string]any{"x": 2})
	e.couch.Put(t, marker, "after", map[string]any{"x": 2})
	e.waitJob(t, rep, marker, 20*time.Second)
	assert.Zero(t, e.pending(t)[work(rep, users[0])], "deleted rule still enqueues")
}

// ruleStillLoaded asks `producer status` whether the rule counts; since status reads the db, the
// producer's own view is checked by the marker-ordered writes in the caller.
func ruleStillLoaded(t *testing.T, e *env, id string) (string, bool) {
	var doc map[string]any
	err := e.couch.Do(t, "GET", "/"+e.cfg.DBName+"/"+id, nil, &doc)
	return "", err == nil
}

// Every db name CouchDB allows flows from the feed to a job subject and back.
func TestSpecialDBNamesFlow(t *testing.T) {
	e := newEnv(t)
	name := e.prefix + "a/b+c$d(e)-f_g"
	if e.couch.PouchDB {
		// PouchDB Server cannot address a db whose name has '/' (it strips %2F from paths); the
		// full name is exercised against Apache CouchDB.
		name = e.prefix + "ab+c$d(e)-f_g"
	}
	e.couch.CreateDB(t, name)
	e.putRule(t, "exact", map[string]any{"type": "replicator", "source": "http://admin@couch.example:5984/" + escapePath(name), "target": e.prefix + "copy"})
	e.startProducer(t)
	e.waitJob(t, rep, name, 20*time.Second)
	e.purge(t)
	e.couch.Put(t, name, "d", map[string]any{"x": 1})
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
		db := e.prefix + "two_" + n
		e.couch.CreateDB(t, db)
		dbs = append(dbs, db)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.prefix + "two_", "source": "$db_name", "target": e.prefix + "all"})
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^" + e.prefix + "two_", "url": "http://127.0.0.1:1/"})
	e.startProducer(t)
	e.startProducer(t)
	for _, db := range dbs {
		e.waitJob(t, rep, db, 20*time.Second)
		e.waitJob(t, onc, db, 20*time.Second)
	}
	e.purge(t)
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
	p := e.pending(t)
	assert.Len(t, p, 2*len(dbs))
	for subj, n := range p {
		assert.Equal(t, uint64(1), n, subj)
	}
}

// CouchDB unreachable for a while, then back: the producer catches up without a restart.
func TestCouchDBOutage(t *testing.T) {
	e := newEnv(t)
	proxy := e.couch.NewProxy(t)
	e.cfg.CouchDBURL = proxy.URL(e.couch.URL)
	e.cfg.CouchDBTimeout = 2 * time.Second
	db := e.prefix + "out"
	e.couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	// Steady state first: a write seen through the feed after the first full round.
	e.purge(t)
	e.couch.Put(t, db, "before", map[string]any{"x": 0})
	e.waitJob(t, rep, db, 20*time.Second)
	e.purge(t)

	proxy.Cut()
	e.couch.Put(t, db, "while-down", map[string]any{"x": 1})
	require.Eventually(t, func() bool { return strings.Contains(e.logs.String(), "retrying") }, 20*time.Second, 100*time.Millisecond,
		"the producer never noticed the outage")
	assert.Zero(t, e.pending(t)[work(rep, db)])
	proxy.Restore(t)
	e.waitJob(t, rep, db, 30*time.Second)
}

// A producer SIGKILLed mid-stream loses nothing: dbs written while it is down get their jobs
// after it restarts.
func TestProducerSIGKILL(t *testing.T) {
	e := newEnv(t)
	a, b := e.prefix+"kill_a", e.prefix+"kill_b"
	e.couch.CreateDB(t, a)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.prefix + "kill_", "source": "$db_name", "target": e.prefix + "all"})

	start := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(),
			"SPIEGEL_TEST_AS_PRODUCER=1",
			"SPIEGEL_COUCHDB_URL="+e.cfg.CouchDBURL,
			"SPIEGEL_DB_NAME="+e.cfg.DBName,
			"SPIEGEL_NATS_URL="+e.cfg.NATSURL,
			"SPIEGEL_POLL_INTERVAL=200ms",
			"SPIEGEL_POSITION_SAVE_INTERVAL=100ms",
			"SPIEGEL_HTTP_ADDR=127.0.0.1:0",
		)
		cmd.Stdout, cmd.Stderr = e.logs, e.logs
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	p1 := start()
	e.waitJob(t, rep, a, 20*time.Second)
	e.purge(t)
	e.couch.Put(t, a, "x1", map[string]any{"x": 1})
	e.waitJob(t, rep, a, 20*time.Second)
	require.NoError(t, p1.Process.Signal(syscall.SIGKILL))
	_ = p1.Wait()
	e.purge(t)

	// Written while no producer runs.
	e.couch.Put(t, a, "x2", map[string]any{"x": 2})
	e.couch.CreateDB(t, b)
	e.couch.Put(t, b, "y", map[string]any{"y": 1})

	start()
	e.waitJob(t, rep, a, 30*time.Second)
	e.waitJob(t, rep, b, 30*time.Second)
}

// SIGTERM stops the producer process cleanly (exit 0) and saves its position.
func TestProducerSIGTERMSavesPosition(t *testing.T) {
	e := newEnv(t)
	db := e.prefix + "term"
	e.couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "SPIEGEL_TEST_AS_PRODUCER=1", "SPIEGEL_COUCHDB_URL="+e.cfg.CouchDBURL,
		"SPIEGEL_DB_NAME="+e.cfg.DBName, "SPIEGEL_NATS_URL="+e.cfg.NATSURL, "SPIEGEL_HTTP_ADDR=127.0.0.1:0",
		"SPIEGEL_POLL_INTERVAL=200ms")
	cmd.Stdout, cmd.Stderr = e.logs, e.logs
	require.NoError(t, cmd.Start())
	e.waitJob(t, rep, db, 20*time.Second)
	// A write seen through the feed; SIGTERM right after it (before the 2s periodic save) must
	// still leave a saved position.
	e.purge(t)
	e.couch.Put(t, db, "d", map[string]any{"x": 1})
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
	var pos map[string]any
	require.NoError(t, e.couch.Do(t, "GET", "/"+e.cfg.DBName+"/spiegel_producer_seq", nil, &pos))
	assert.NotEmpty(t, pos["last_seq"])
	assert.NotEmpty(t, pos["rules_seq"])
}

// A producer started before install exits with a message that says to run install.
func TestProducerBeforeInstall(t *testing.T) {
	e := newEnv(t)
	var stderr strings.Builder
	t.Setenv("SPIEGEL_COUCHDB_URL", e.couch.URL)
	t.Setenv("SPIEGEL_DB_NAME", e.prefix+"never_installed")
	t.Setenv("SPIEGEL_NATS_URL", e.cfg.NATSURL)
	t.Setenv("SPIEGEL_SUBJECT_PREFIX", "other")
	t.Setenv("SPIEGEL_HTTP_ADDR", "")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	code := realMain(ctx, nil, strings.NewReader(""), &strings.Builder{}, &stderr)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr.String(), "producer install")
}
