package main

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
)

// delivered returns, per db param, the set of ids the sink answered with 2xx.
func delivered(hs []hit) map[string]map[string]int {
	out := map[string]map[string]int{}
	for _, h := range hs {
		db := h.param("db")
		if out[db] == nil {
			out[db] = map[string]int{}
		}
		out[db][h.param("id")]++
	}
	return out
}

// TestLostWakeup hammers one db while a slow webhook holds its job: writes that land while the
// job runs are refused as duplicate jobs, and must still all be delivered.
func TestLostWakeup(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	s := newSink(t, func(hit, int) (int, time.Duration) { return 200, 40 * time.Millisecond })
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/x", "block": true, "params": map[string]any{"id": "$change.id", "db": "$db_name"}})
	const n = 60
	for i := range n {
		e.Couch.Put(t, db, fmt.Sprintf("d%03d", i), map[string]any{})
		e.enqueue(t, db) // as the producer does; mostly refused while the job is pending
		time.Sleep(10 * time.Millisecond)
	}
	s.waitHits(t, 60*time.Second, func(hs []hit) bool { return len(delivered(hs)[db]) == n }, "not every write delivered")
}

// TestTwoRunnersManyDBs: two consumers share the work of many active dbs; every change is
// delivered, and per db no two requests ever overlap in time (one job per db at a time).
func TestTwoRunnersManyDBs(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	a, b := e.start(t), e.start(t)
	s := newSink(t, func(hit, int) (int, time.Duration) { return 200, 2 * time.Millisecond })
	const dbs, rounds = 30, 3
	var names []string
	for range dbs {
		names = append(names, e.Couch.NewDB(t, e.Prefix+"m_"))
	}
	rev := e.putRule(t, "r", map[string]any{"db_name": "^" + regexp.QuoteMeta(e.Prefix+"m_"), "url": s.URL + "/x", "block": true,
		"params": map[string]any{"id": "$change.id", "db": "$db_name"}})
	waitRule(t, "r", rev, a, b)
	var wg sync.WaitGroup
	for _, db := range names {
		wg.Go(func() {
			for r := range rounds {
				for k := range 2 {
					e.Couch.Put(t, db, fmt.Sprintf("r%d_%d", r, k), map[string]any{})
					e.enqueue(t, db)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	hs := s.waitHits(t, 90*time.Second, func(hs []hit) bool {
		d := delivered(hs)
		for _, db := range names {
			if len(d[db]) != rounds*2 {
				return false
			}
		}
		return true
	}, "not every change delivered")
	perDB := map[string][]hit{}
	for _, h := range hs {
		perDB[h.param("db")] = append(perDB[h.param("db")], h)
	}
	dups := 0
	for db, list := range perDB {
		sort.Slice(list, func(i, j int) bool { return list[i].Start.Before(list[j].Start) })
		for i := 1; i < len(list); i++ {
			assert.False(t, list[i].Start.Before(list[i-1].End), "db %s: requests overlap", db)
		}
		dups += len(list) - rounds*2
	}
	t.Logf("%d requests for %d changes (%d duplicates)", len(hs), dbs*rounds*2, dups)
}

// TestSIGKILLMidBatch kills a real onchange process while it holds a db's job; another process
// finishes the db within AckWait plus a few seconds and no change is lost.
func TestSIGKILLMidBatch(t *testing.T) {
	const ackWait = 3 * time.Second
	e := newEnv(t, ackWait)
	db := e.Couch.NewDB(t, e.Prefix)
	s := newSink(t, func(hit, int) (int, time.Duration) { return 200, 50 * time.Millisecond })
	e.putRule(t, "r", map[string]any{"db_name": only(db), "url": s.URL + "/x", "block": true, "params": map[string]any{"id": "$change.id", "db": "$db_name"}})
	const n = 40
	for i := range n {
		e.Couch.Put(t, db, fmt.Sprintf("d%03d", i), map[string]any{})
	}

	child := exec.Command(os.Args[0])
	child.Env = append(os.Environ(), "SPIEGEL_TEST_AS_ONCHANGE=1", "SPIEGEL_WEBHOOK_ALLOWED_HOSTS=127.0.0.1",
		"SPIEGEL_COUCHDB_URL="+e.cfg.CouchDBURL, "SPIEGEL_DB_NAME="+e.cfg.DBName, "SPIEGEL_NATS_URL="+e.NATS.URL(),
		"SPIEGEL_ACK_WAIT="+ackWait.String(), "SPIEGEL_HTTP_ADDR=127.0.0.1:0", "SPIEGEL_CHANGES_BATCH=5", "SPIEGEL_LOG_LEVEL=debug")
	var childLog syncBuffer
	child.Stdout, child.Stderr = &childLog, &childLog
	require.NoError(t, child.Start())
	t.Cleanup(func() {
		_ = child.Process.Kill()
		if t.Failed() {
			t.Logf("child logs:\n%s", spiegeltest.Tail(childLog.String(), 40))
		}
	})
	e.enqueue(t, db)
	s.waitHits(t, 30*time.Second, func(hs []hit) bool { return len(hs) >= 8 }, "child never started the batch")
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	_, _ = child.Process.Wait()
	killed := time.Now()
	before := len(s.all())

	e.start(t)
	s.waitHits(t, ackWait+15*time.Second, func(hs []hit) bool { return len(delivered(hs)[db]) == n }, "db not finished after the kill")
	took := time.Since(killed)
	total := len(s.all())
	assert.Less(t, before, n, "the kill happened mid-batch")
	t.Logf("finished %s after SIGKILL; %d requests for %d changes (%d duplicates)", took.Round(100*time.Millisecond), total, n, total-n)
}
