package main

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/healthtest"
)

// The producer's /readyz turns 503 while CouchDB or NATS is down, naming the failing dependency,
// and 200 again once it is back, without a restart; /healthz stays 200 all along. Work done
// after each outage proves the producer recovered, not just its probe.
func TestProducerReadyzFollowsDependencies(t *testing.T) {
	e := newEnv(t)
	proxy := e.Couch.NewProxy(t)
	e.cfg.CouchDBURL = proxy.URL(e.Couch.URL)
	e.cfg.CouchDBTimeout = 2 * time.Second
	addr := healthtest.FreeAddr(t)
	e.cfg.HTTPAddr = addr
	db := e.Prefix + "ready"
	e.Couch.CreateDB(t, db)
	e.putRule(t, "rep", map[string]any{"type": "replicator", "source": db, "target": db + "_copy"})
	e.startProducer(t)

	allOK := func(r healthtest.Ready) {
		t.Helper()
		assert.True(t, r.Ready)
		assert.Equal(t, map[string]string{"couchdb": "ok", "nats": "ok", "stream": "ok", "feed": "ok"}, r.Checks)
	}
	live := func() {
		t.Helper()
		status, err := healthtest.GetStatus(addr, "/healthz")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "/healthz must not depend on CouchDB or NATS")
	}
	allOK(healthtest.WaitReady(t, addr, http.StatusOK, 20*time.Second))
	e.waitJob(t, rep, db, 20*time.Second)
	e.Purge(t)

	t.Log("CouchDB down")
	proxy.Cut()
	r := healthtest.WaitReady(t, addr, http.StatusServiceUnavailable, 10*time.Second)
	assert.False(t, r.Ready)
	assert.Contains(t, r.Checks["couchdb"], e.cfg.DBName, "the body names CouchDB and what was asked of it")
	assert.Equal(t, "ok", r.Checks["nats"])
	assert.Equal(t, "ok", r.Checks["stream"])
	r = healthtest.WaitReadyWhen(t, addr, 4*e.cfg.FeedHeartbeat, "the feed check names the interrupted feed", func(_ int, r healthtest.Ready) bool {
		return r.Checks["feed"] != "ok" && r.Checks["feed"] != ""
	})
	t.Logf("503 body while CouchDB is down: %+v", r)
	live()
	proxy.Restore(t)
	allOK(healthtest.WaitReady(t, addr, http.StatusOK, 15*time.Second))
	e.Couch.Put(t, db, "after-couch", map[string]any{"x": 1})
	e.waitJob(t, rep, db, 20*time.Second)
	e.Purge(t)

	t.Log("NATS down")
	e.NATS.Stop()
	r = healthtest.WaitReadyWhen(t, addr, 10*time.Second, "503 naming NATS in both NATS checks", func(status int, r healthtest.Ready) bool {
		return status == http.StatusServiceUnavailable && strings.Contains(r.Checks["nats"], "not connected") &&
			strings.Contains(r.Checks["stream"], "NATS not connected")
	})
	assert.False(t, r.Ready)
	assert.Equal(t, "ok", r.Checks["couchdb"])
	t.Logf("503 body while NATS is down: %+v", r)
	live()
	// Written while NATS is down: its job must reach the stream once NATS is back.
	e.Couch.Put(t, db, "while-nats-down", map[string]any{"x": 2})
	e.NATS.StartAgain(t)
	allOK(healthtest.WaitReady(t, addr, http.StatusOK, 15*time.Second))
	e.waitJob(t, rep, db, 30*time.Second)
}
