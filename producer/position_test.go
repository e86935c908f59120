package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
)

// startProcess starts the test binary as a producer process of e (its config as SPIEGEL_*
// variables, then extra, which win) and kills it when the test ends. Hot feeds are off unless
// extra turns them on: they hold the saved position behind the events they cover (hot_test.go),
// and the position tests want it exact. The sweep is off, as in newEnv.
func (e *env) startProcess(t *testing.T, extra ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(),
		"SPIEGEL_TEST_AS_PRODUCER=1",
		"SPIEGEL_COUCHDB_URL="+e.cfg.CouchDBURL,
		"SPIEGEL_DB_NAME="+e.cfg.DBName,
		"SPIEGEL_NATS_URL="+e.cfg.NATSURL,
		"SPIEGEL_POLL_INTERVAL=200ms",
		"SPIEGEL_FEED_HEARTBEAT=2s",
		"SPIEGEL_POSITION_SAVE_INTERVAL=100ms",
		"SPIEGEL_HTTP_ADDR=127.0.0.1:0",
		"SPIEGEL_HOT_FEEDS=0",
		"SPIEGEL_SWEEP_INTERVAL=0", // as in newEnv
	)
	cmd.Env = append(cmd.Env, extra...)
	cmd.Stdout, cmd.Stderr = e.Logs, e.Logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

// waitRulesCaughtUp waits until the saved position records the rules seq: the rules' catch-up
// jobs are acknowledged, and none is published again (a catch-up that fails, e.g. on a slow
// server, is retried whole, publishing its jobs again).
func (e *env) waitRulesCaughtUp(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool { return e.position(t).RulesSeq != "" }, 30*time.Second, 20*time.Millisecond,
		"the saved position never recorded the rules' catch-up")
}

// position returns the saved producer position (zero when there is none).
func (e *env) position(t *testing.T) checkpoint.Position {
	t.Helper()
	var pos checkpoint.Position
	_ = e.Couch.Do(t, http.MethodGet, "/"+couchtest.PathDB(e.cfg.DBName)+"/"+checkpoint.ProducerPositionID, nil, &pos)
	return pos
}

// updatesSince returns the db names of the _db_updates events after since; ok is false when
// the server refuses since (e.g. a position saved from the poll source).
func (e *env) updatesSince(t *testing.T, since string) (dbs []string, ok bool) {
	t.Helper()
	var body struct {
		Results []struct {
			DB string `json:"db_name"`
		} `json:"results"`
	}
	if err := e.Couch.Do(t, http.MethodGet, "/_db_updates?feed=normal&since="+url.QueryEscape(since), nil, &body); err != nil {
		return nil, false
	}
	for _, r := range body.Results {
		dbs = append(dbs, r.DB)
	}
	return dbs, true
}

// count returns how often s occurs in list.
func count(list []string, s string) int {
	n := 0
	for _, x := range list {
		if x == s {
			n++
		}
	}
	return n
}

// hasEventOf reports whether _db_updates has an event of db after since.
func (e *env) hasEventOf(t *testing.T, db, since string) bool {
	dbs, ok := e.updatesSince(t, since)
	return ok && slices.Contains(dbs, db)
}

// updatesMark returns the current position of _db_updates: events after it are the ones that
// happen from now on.
func (e *env) updatesMark(t *testing.T) string {
	t.Helper()
	var body struct {
		LastSeq json.RawMessage `json:"last_seq"`
	}
	require.NoError(t, e.Couch.Do(t, http.MethodGet, "/_db_updates?feed=normal&since=now", nil, &body))
	return seqText(body.LastSeq)
}

// seqText returns a JSON seq (a string, or a number on some servers) as text.
func seqText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) != nil {
		s = string(raw)
	}
	return s
}

// waitSettled waits until _db_updates has an event of db after mark and then until the saved
// position is past every event of db: the producer has handled, published and saved all of
// them. Exact only with the proxy's own feed (couchtest.AlwaysSynthesize), whose pending rows
// Flush hands out at once: CouchDB announces a write up to half a second late and may announce
// a db again after its first row of a window has been read, which no test can wait for.
func (e *env) waitSettled(t *testing.T, db, mark string) {
	t.Helper()
	e.updates.Flush()
	require.Eventually(t, func() bool { return e.hasEventOf(t, db, mark) }, 20*time.Second, 20*time.Millisecond,
		"no _db_updates event of %s", db)
	require.Eventually(t, func() bool {
		pos := e.position(t)
		dbs, ok := e.updatesSince(t, pos.LastSeq)
		return pos.LastSeq != "" && ok && !slices.Contains(dbs, db)
	}, 20*time.Second, 50*time.Millisecond, "the saved position never passed %s", db)
}

// A producer SIGKILLed mid-stream loses nothing, and with a feed that has positions it resumes
// from its saved one: dbs written while it is down get their jobs after it restarts, and a db
// whose event was before the saved position gets none (the poll source, which has no
// positions, re-emits every db and is checked for the first part only).
func TestProducerSIGKILL(t *testing.T) {
	for _, source := range []string{"db_updates", "poll"} {
		t.Run(source, func(t *testing.T) {
			e := newEnv(t, couchtest.AlwaysSynthesize())
			a, b, c := e.Prefix+"kill_a", e.Prefix+"kill_b", e.Prefix+"kill_c"
			mark := e.updatesMark(t)
			e.Couch.CreateDB(t, a)
			e.Couch.CreateDB(t, c)
			e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "kill_", "source": "$db_name", "target": e.Prefix + "all"})

			p1 := e.startProcess(t, "SPIEGEL_SOURCE="+source)
			e.waitJob(t, rep, a, 20*time.Second)
			e.waitJob(t, rep, c, 20*time.Second)
			e.Purge(t)
			e.Couch.Put(t, c, "c1", map[string]any{"x": 1})
			e.Couch.Put(t, a, "x1", map[string]any{"x": 1})
			e.waitJob(t, rep, a, 20*time.Second)
			e.waitJob(t, rep, c, 20*time.Second)
			if source == "db_updates" {
				e.waitSettled(t, c, mark)
				e.waitRulesCaughtUp(t) // else the restart runs the catch-up again: a job for c

			}
			require.NoError(t, p1.Process.Signal(syscall.SIGKILL))
			_ = p1.Wait()
			e.Purge(t)

			// Written while no producer runs.
			e.Couch.Put(t, a, "x2", map[string]any{"x": 2})
			e.Couch.CreateDB(t, b)
			e.Couch.Put(t, b, "y", map[string]any{"y": 1})

			e.startProcess(t, "SPIEGEL_SOURCE="+source)
			e.waitJob(t, rep, a, 30*time.Second)
			e.waitJob(t, rep, b, 30*time.Second)
			if source == "db_updates" {
				if !assert.Zero(t, e.Pending(t)[work(rep, c)], "resumed from the saved position, not from the beginning") {
					t.Logf("reason of the job of %s: %q", c, e.jobReason(t, rep, c))
				}
			}
		})
	}
}

// An idle producer writes nothing: no position save while no db but the spiegel db changes, and
// the spiegel db's own events (its position saves among them) do not make a save due.
func TestIdleProducerWritesNothing(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	db := e.Prefix + "idle"
	mark := e.updatesMark(t)
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.cfg.PositionSaveInterval = 50 * time.Millisecond
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	e.waitRulesCaughtUp(t)
	e.Couch.Put(t, db, "d", map[string]any{"x": 1})
	e.waitSettled(t, db, mark)

	saves := func() int {
		return e.updates.Requests(http.MethodPut, "/"+couchtest.PathDB(e.cfg.DBName)+"/"+checkpoint.ProducerPositionID)
	}
	// The last save's own event is still to be read: wait until nothing has been written for
	// 10 save intervals in a row.
	last, still := -1, 0
	require.Eventually(t, func() bool {
		if n := e.updates.Writes(); n != last {
			last, still = n, 0
		} else {
			still++
		}
		return still >= 10
	}, 20*time.Second, e.cfg.PositionSaveInterval, "the producer never came to rest")
	writes := e.updates.Writes()
	before := saves()
	// 40 save intervals, each one a chance for a self-inflicted save.
	time.Sleep(40 * e.cfg.PositionSaveInterval)
	assert.Equal(t, before, saves(), "position saves while idle")
	assert.Equal(t, writes, e.updates.Writes(), "writes of any kind while idle")

	// And the next real write is saved again.
	mark = e.updatesMark(t)
	e.Couch.Put(t, db, "d2", map[string]any{"x": 2})
	e.waitSettled(t, db, mark)
	assert.Greater(t, saves(), before)
}

// _db_updates may drop events: the reconciliation sweep enqueues a matched db whose update_seq
// changed although the feed never said so (here: a write the feed does not see).
func TestSweepCatchesDroppedEvents(t *testing.T) {
	// CouchDB's own _db_updates sees every write: the proxy's feed stands in for it everywhere.
	e := newEnv(t, couchtest.AlwaysSynthesize())
	db := e.Prefix + "dropped"
	mark := e.updatesMark(t)
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.cfg.SweepInterval = 300 * time.Millisecond
	e.startProducer(t)
	e.waitJob(t, rep, db, 20*time.Second)
	e.waitSettled(t, db, mark) // no event of db left to enqueue it
	// Nor the rule's catch-up: on a loaded server it can publish its job after the purge below,
	// a job of reason "rule" that the sweep's would then be deduplicated against.
	e.waitRulesCaughtUp(t)
	// The sweeps run one after another: once the second has started, the first (the baseline)
	// has its answer. Counting the first request alone let the write below land before CouchDB
	// answered the baseline, which then already held it.
	require.Eventually(t, func() bool { return e.updates.Requests(http.MethodPost, "/_dbs_info") >= 2 }, 20*time.Second, 20*time.Millisecond,
		"the first sweep (the baseline) never finished")
	e.Purge(t)
	e.direct.Put(t, db, "unseen", map[string]any{"x": 1})
	e.waitJob(t, rep, db, 20*time.Second)
	assert.Equal(t, events.ReasonSweep, e.jobReason(t, rep, db), "the job came from the sweep")
}

// couchClient returns a product client for url.
func couchClient(t *testing.T, url string) *couch.Client {
	t.Helper()
	c, err := couch.New(couch.Config{URL: url}, nil)
	require.NoError(t, err)
	return c
}

// spiegelSeq returns the spiegel db's update_seq: a rules seq with nothing to catch up.
func (e *env) spiegelSeq(t *testing.T) string {
	t.Helper()
	info, err := couchClient(t, e.cfg.CouchDBURL).DBInfo(t.Context(), e.cfg.DBName)
	require.NoError(t, err)
	return info.UpdateSeq
}

// A saved position the feed cannot resume from — one of another source, or one the server
// refuses — starts the feed from now and enqueues every matched db once, with one log line
// saying why; the feed does not loop on the refusal.
func TestUnusablePositionStartsOver(t *testing.T) {
	for _, c := range []struct {
		name       string
		pos        checkpoint.Position
		wantReason string
	}{
		{"another source", checkpoint.Position{LastSeq: "poll", Source: "poll"}, "from source poll"},
		{"refused by the server", checkpoint.Position{LastSeq: "999-g1AAAA!not-a-seq", Source: "db_updates"}, "refused the saved position"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, couchtest.AlwaysSynthesize())
			old, later := e.Prefix+"old", e.Prefix+"later"
			mark := e.updatesMark(t)
			e.Couch.CreateDB(t, old)
			e.Couch.Put(t, old, "d", map[string]any{"x": 1})
			// Both events of old (created, updated) are in the feed before the producer starts
			// from now: only the resync can enqueue old.
			require.Eventually(t, func() bool {
				dbs, _ := e.updatesSince(t, mark)
				return count(dbs, old) == 2
			}, 20*time.Second, 20*time.Millisecond)
			e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "(old|later)$", "source": "$db_name", "target": e.Prefix + "all"})
			pos := c.pos
			pos.RulesSeq = e.spiegelSeq(t) // no rule to catch up: the resync alone enqueues old
			require.NoError(t, checkpoint.NewStore(couchClient(t, e.cfg.CouchDBURL), e.cfg.DBName).SavePosition(t.Context(), pos))

			e.startProducer(t)
			e.waitJob(t, rep, old, 20*time.Second)
			assert.Equal(t, events.ReasonResync, e.jobReason(t, rep, old))
			mark = e.updatesMark(t)
			e.Couch.CreateDB(t, later)
			e.Couch.Put(t, later, "d", map[string]any{"x": 1})
			e.waitJob(t, rep, later, 20*time.Second)
			e.waitSettled(t, later, mark)
			assert.Equal(t, "db_updates", e.position(t).Source)

			logs := e.Logs.String()
			assert.Equal(t, 1, strings.Count(logs, "starting the db updates feed from now"), "one log line says why")
			assert.Contains(t, logs, c.wantReason)
			assert.LessOrEqual(t, strings.Count(logs, "db updates feed failed"), 1, "no loop on the refused position")
		})
	}
}

// A first start does not read the feed's history, which grows with every db the server ever
// had (a test server's with every test run: 220,000 rows held a first start back for minutes
// before it saw a new write). Its feed starts at the server's current position, and the rules'
// catch-up, which waits for the feed to run, enqueues the dbs written before.
func TestFirstStartSkipsTheHistory(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	old, later := e.Prefix+"old", e.Prefix+"later"
	e.Couch.CreateDB(t, old)
	e.Couch.Put(t, old, "d", map[string]any{"x": 1})
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "(old|later)$", "source": "$db_name", "target": e.Prefix + "all"})
	e.updates.Flush() // old's rows are history before the producer starts

	e.startProducer(t)
	e.waitJob(t, rep, old, 20*time.Second)
	assert.Equal(t, events.ReasonRule, e.jobReason(t, rep, old), "the rule's catch-up enqueued it")
	mark := e.updatesMark(t)
	e.Couch.CreateDB(t, later)
	e.Couch.Put(t, later, "d", map[string]any{"x": 1})
	e.waitJob(t, rep, later, 20*time.Second)
	e.waitSettled(t, later, mark)

	feeds := 0
	for _, q := range e.updates.Queries(http.MethodGet, "/_db_updates") {
		if q.Get("feed") == "continuous" {
			feeds++
			assert.NotContains(t, []string{"", "0"}, q.Get("since"), "a feed read from the beginning")
		}
	}
	assert.Positive(t, feeds)
}

// The rules' catch-up of a first start waits until the feed has fixed its position at the
// server: a db written before that is listed by the catch-up, whatever the feed's position
// turns out to be. Here the feed connects late, after a db was created and written: a catch-up
// that did not wait would have listed the dbs before that db existed, and a feed that starts
// after its events would never show it (the sweep is off).
func TestFirstStartCatchUpWaitsForTheFeed(t *testing.T) {
	e := newEnv(t, couchtest.AlwaysSynthesize())
	old, gap := e.Prefix+"old", e.Prefix+"gap"
	e.Couch.CreateDB(t, old)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "(old|gap)$", "source": "$db_name", "target": e.Prefix + "all"})
	release := e.updates.HoldFeeds()
	t.Cleanup(release)

	e.startProducer(t)
	require.Eventually(t, func() bool { return e.updates.FeedsWaiting() > 0 }, 20*time.Second, 20*time.Millisecond, "the producer's feed request")
	assert.Never(t, func() bool { return e.Pending(t)[work(rep, old)] > 0 }, time.Second, 50*time.Millisecond,
		"the catch-up ran before the feed did")
	e.Couch.CreateDB(t, gap)
	e.Couch.Put(t, gap, "d", map[string]any{"x": 1})
	e.updates.Flush() // gap's rows are before any position the feed resolves from now on
	release()
	e.waitJob(t, rep, old, 20*time.Second)
	e.waitJob(t, rep, gap, 20*time.Second)
}

// A feed refused permanently (here 401: credentials that get fixed later) does not leave a
// producer that looks ready and does nothing: /readyz answers 503 naming the feed and its
// reason, the feed is retried, and once the credentials work again jobs flow.
func TestPermanentFeedErrorIsRetriedAndReported(t *testing.T) {
	e := newEnv(t)
	db := e.Prefix + "auth"
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})

	var refuse atomic.Bool
	refuse.Store(true)
	upstream, err := url.Parse(e.cfg.CouchDBURL)
	require.NoError(t, err)
	upstream.User = nil
	rp := httputil.NewSingleHostReverseProxy(upstream)
	rp.FlushInterval = -1
	gate := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if refuse.Load() && strings.HasPrefix(r.URL.Path, "/_db_updates") {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte(`{"error":"unauthorized","reason":"You are not a server admin."}`))
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(gate.Close)
	gateURL, _ := url.Parse(e.cfg.CouchDBURL)
	gateURL.Host = strings.TrimPrefix(gate.URL, "http://")
	e.cfg.CouchDBURL = gateURL.String()
	e.cfg.Source = "db_updates"
	addr := healthtest.FreeAddr(t)
	e.cfg.HTTPAddr = addr
	e.startProducer(t)

	r := healthtest.WaitReadyWhen(t, addr, 20*time.Second, "503 naming the refused feed", func(status int, r healthtest.Ready) bool {
		return status == http.StatusServiceUnavailable && strings.Contains(r.Checks["feed"], "401")
	})
	assert.Equal(t, "ok", r.Checks["couchdb"])
	assert.Contains(t, e.Logs.String(), "db updates feed failed: retrying")

	refuse.Store(false)
	healthtest.WaitReady(t, addr, http.StatusOK, 30*time.Second)
	e.Couch.Put(t, db, "after", map[string]any{"x": 1})
	e.waitJob(t, rep, db, 20*time.Second)
}
