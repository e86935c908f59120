package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// startServing runs the replicator in-process, as main wires it, with its health and metrics
// listener on a free loopback address, which it returns. It stops when the test ends.
func (e *env) startServing(t testing.TB) (addr string, app *consumer.App) {
	t.Helper()
	cfg := e.cfg
	cfg.HTTPAddr = healthtest.FreeAddr(t)
	app = e.runApp(t, &cfg, cfg.HTTPAddr, func(app *consumer.App) worker.Handler { return newHandler(app.Deps, &cfg).handle })
	return cfg.HTTPAddr, app
}

// /metrics counts a known workload exactly: K jobs, each replicating one source with one rule,
// give K ok replications per engine and as many docs written as the sources hold; running the
// same jobs again adds K replications and no docs (nothing new to write).
func TestMetricsCountReplications(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 30*time.Second)
	addr, app := e.startServing(t)

	type source struct {
		db, target, engine string
		docs               int
	}
	sources := []source{
		{db: e.Prefix + "a", engine: rules.EngineCouchDB, docs: 3},
		{db: e.Prefix + "b", engine: rules.EngineCouchDB, docs: 7},
		{db: e.Prefix + "c", engine: rules.EngineCouchDB, docs: 12},
		{db: e.Prefix + "d", engine: rules.EngineNative, docs: 5},
		{db: e.Prefix + "e", engine: rules.EngineNative, docs: 9},
	}
	perEngine := map[string]int{}
	totalDocs := 0
	for i := range sources {
		s := &sources[i]
		s.target = s.db + "_copy"
		e.Couch.CreateDB(t, s.db)
		e.Couch.CreateDB(t, s.target)
		bulkDocs(t, e.Couch, s.db, 0, s.docs)
		e.Couch.Put(t, e.cfg.DBName, "rule_"+s.db[len(e.Prefix):], map[string]any{
			"type": "replicator", "source": s.db, "target": s.target, "engine": s.engine})
		perEngine[s.engine]++
		totalDocs += s.docs
	}
	require.Eventually(t, func() bool {
		for _, s := range sources {
			if len(app.Rules.Replicators(s.db)) != 1 {
				return false
			}
		}
		return true
	}, 15*time.Second, 20*time.Millisecond, "rules not loaded")

	rep := string(events.GroupReplicate)
	// run publishes one job per source (each db is written before its job exists, and no job is
	// pending when it is published: nothing is deduplicated) and waits until all are done.
	run := func(round int) healthtest.Samples {
		t.Helper()
		for _, s := range sources {
			e.publish(t, s.db)
		}
		var m healthtest.Samples
		require.Eventually(t, func() bool {
			m = healthtest.Scrape(t, addr)
			return m.Get("spiegel_jobs_total", "group", rep, "result", "ok") >= float64(round*len(sources)) &&
				m.Has("spiegel_jobs_pending", "group", rep) && m.Get("spiegel_jobs_pending", "group", rep) == 0 &&
				m.Has("spiegel_jobs_in_flight", "group", rep) && m.Get("spiegel_jobs_in_flight", "group", rep) == 0
		}, 30*time.Second, 50*time.Millisecond, "round %d: the jobs did not finish", round)
		for _, s := range sources {
			assert.Len(t, revs(t, e.Couch, s.target), s.docs, "round %d: %s copied", round, s.db)
		}
		return m
	}
	check := func(m healthtest.Samples, round int) {
		t.Helper()
		for _, engine := range []string{rules.EngineCouchDB, rules.EngineNative} {
			assert.Equal(t, float64(round*perEngine[engine]), m.Get("spiegel_replications_total", "engine", engine, "result", "ok"),
				"round %d: ok replications of engine %s", round, engine)
			for _, result := range []string{"error", "missing_source"} {
				assert.Zero(t, m.Get("spiegel_replications_total", "engine", engine, "result", result), "%s %s", engine, result)
			}
		}
		assert.Equal(t, float64(round*len(sources)), m.Get("spiegel_replication_duration_seconds_count"), "round %d", round)
		assert.Equal(t, float64(totalDocs), m.Get("spiegel_replication_docs_written_total"),
			"round %d: docs written are the docs of the sources, once", round)
		assert.Equal(t, float64(round*len(sources)), m.Get("spiegel_jobs_total", "group", rep, "result", "ok"), "round %d", round)
		for _, result := range []string{"retry", "delayed", "failed"} {
			assert.Zero(t, m.Get("spiegel_jobs_total", "group", rep, "result", result), result)
		}
		assert.Zero(t, m.Get("spiegel_dead_letters_total", "group", rep))
		assert.Equal(t, float64(len(sources)), m.Get("spiegel_rules_loaded", "kind", "replicator"))
		assert.Equal(t, 1.0, m.Get("spiegel_build_info", "component", events.GroupReplicate.ConsumerName(), "version", config.Version))
	}
	check(run(1), 1)
	check(run(2), 2)
	assert.Empty(t, e.deadLetters(t))
}
