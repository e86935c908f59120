package main

import (
	"fmt"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
)

// /metrics counts a known workload exactly: one job per db, one webhook request per change and
// one more for the single request the sink refuses once, each in its status class.
func TestMetricsCountKnownWorkload(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 60*time.Second)
	addr := healthtest.FreeAddr(t)
	e.cfg.HTTPAddr = addr
	app := e.start(t)

	docsPerDB := []int{4, 5, 6}
	var dbs []string
	changes := 0
	for _, n := range docsPerDB {
		db := e.Couch.NewDB(t, e.Prefix+"mx_")
		for i := range n {
			e.Couch.Put(t, db, fmt.Sprintf("d%03d", i), map[string]any{"i": i})
		}
		dbs = append(dbs, db)
		changes += n
	}
	var refused atomic.Bool
	s := newSink(t, func(h hit, _ int) (int, time.Duration) {
		if h.param("db") == dbs[0] && h.param("id") == "d001" && refused.CompareAndSwap(false, true) {
			return 503, 0
		}
		return 200, 0
	})
	rev := e.putRule(t, "hook", map[string]any{"db_name": "^" + regexp.QuoteMeta(e.Prefix+"mx_"), "url": s.URL + "/hook", "block": true,
		"params": map[string]any{"id": "$change.id", "db": "$db_name"}, "retry": map[string]any{"backoff": "linear", "delay_ms": 10, "limit": 3}})
	waitRule(t, "hook", rev, app)

	// Every change is written before any job exists, and each db gets exactly one job: nothing
	// is deduplicated and no lost-wakeup job follows (no db changes after its job read it).
	for _, db := range dbs {
		e.enqueue(t, db)
	}
	onc := string(events.GroupOnChange)
	var m healthtest.Samples
	require.Eventually(t, func() bool {
		m = healthtest.Scrape(t, addr)
		// A job's count and its duration are recorded one after the other: a scrape between
		// them sees the count only.
		return m.Get("spiegel_jobs_total", "group", onc, "result", "ok") >= float64(len(dbs)) &&
			m.Get("spiegel_job_duration_seconds_count", "group", onc) >= float64(len(dbs)) &&
			m.Has("spiegel_jobs_pending", "group", onc) && m.Get("spiegel_jobs_pending", "group", onc) == 0 &&
			m.Has("spiegel_jobs_in_flight", "group", onc) && m.Get("spiegel_jobs_in_flight", "group", onc) == 0
	}, 30*time.Second, 50*time.Millisecond, "the jobs did not finish")

	// The sink's own count first: the workload is what the test thinks it is.
	hs := s.all()
	d := delivered(hs)
	for i, db := range dbs {
		assert.Len(t, d[db], docsPerDB[i], "changes of %s delivered", db)
	}
	require.Len(t, hs, changes+1, "one request per change, plus the refused one")

	assert.Equal(t, float64(changes), m.Get("spiegel_webhook_requests_total", "class", "2xx"))
	assert.Equal(t, 1.0, m.Get("spiegel_webhook_requests_total", "class", "5xx"))
	for _, class := range []string{"3xx", "4xx", "error"} {
		assert.Zero(t, m.Get("spiegel_webhook_requests_total", "class", class), class)
	}
	assert.Equal(t, float64(changes), m.Get("spiegel_webhook_request_duration_seconds_count", "class", "2xx"))
	assert.Equal(t, float64(len(dbs)), m.Get("spiegel_jobs_total", "group", onc, "result", "ok"))
	for _, result := range []string{"retry", "delayed", "failed"} {
		assert.Zero(t, m.Get("spiegel_jobs_total", "group", onc, "result", result), result)
	}
	assert.Equal(t, float64(len(dbs)), m.Get("spiegel_job_duration_seconds_count", "group", onc))
	assert.Zero(t, m.Get("spiegel_dead_letters_total", "group", onc))
	assert.Zero(t, m.Get("spiegel_changes_published_total"))
	assert.Equal(t, 1.0, m.Get("spiegel_rules_loaded", "kind", "on_change"))
	assert.Zero(t, m.Get("spiegel_rules_rejected"))
	assert.Equal(t, 1.0, m.Get("spiegel_build_info", "component", events.GroupOnChange.ConsumerName(), "version", config.Version))
}
