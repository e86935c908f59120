package status

import (
	"encoding/json"
	"errors"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

func TestServiceNameAndSubject(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ prefix, component, name, subject string }{
		{"", ComponentProducer, "spiegel-producer", "spiegel.svc.producer.status"},
		{"spiegel", ComponentReplicator, "spiegel-replicator", "spiegel.svc.replicator.status"},
		{"staging", ComponentOnChange, "staging-onchange", "staging.svc.onchange.status"},
		{"acme.spiegel", ComponentProducer, "acme_spiegel-producer", "acme.spiegel.svc.producer.status"},
	} {
		assert.Equal(t, c.name, ServiceName(c.prefix, c.component), c.prefix)
		assert.Equal(t, c.subject, StatusSubject(c.prefix, c.component), c.prefix)
	}
}

func TestSemVer(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"1.2.3": "1.2.3", "v1.4.0": "1.4.0", "1.0.0-rc.1": "1.0.0-rc.1", "dev": "0.0.0+dev",
		"v1.2.3-4-gabcdef-dirty": "1.2.3-4-gabcdef-dirty", "abc/def 1": "0.0.0+abc-def-1", "": "0.0.0+unknown",
	} {
		assert.Equal(t, want, SemVer(in), in)
	}
}

// clock is a settable time source.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) get() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// The recorder keeps per-rule last run, result and error, counts failures of the last hour
// (older ones drop out), counts jobs by result, and keeps no password of an error text.
func TestRecorder(t *testing.T) {
	t.Parallel()
	c := &clock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	r := NewRecorder()
	r.now = c.get

	r.RuleRun("rep", ResultError, errors.New("replicate http://repl:S3CRET@target.example/db: 503"))
	c.add(30 * time.Minute)
	r.RuleRun("rep", ResultFailed, errors.New("credentials refused"))
	r.GaveUp("hook", errors.New("request to http://hook:S3CRET@hook.example/ given up"))
	c.add(20 * time.Minute)
	r.RuleRun("rep", ResultOK, nil)
	r.RuleRun("hook", ResultDeferred, errors.New("500 from hook.example"))
	r.JobDone("replicate", "ok", time.Second)
	r.JobDone("replicate", "ok", time.Second)
	r.JobDone("replicate", "retry", time.Second)

	var rep Report
	r.Fill(&rep)
	rs := rep.RuleStats["rep"]
	assert.Equal(t, ResultOK, rs.LastResult)
	assert.Empty(t, rs.LastError)
	assert.Equal(t, c.get(), rs.LastRun)
	assert.Equal(t, uint64(3), rs.Runs)
	assert.Equal(t, uint64(2), rs.Failures)
	assert.Equal(t, 2, rs.FailuresLastHour)
	hook := rep.RuleStats["hook"]
	assert.Equal(t, ResultDeferred, hook.LastResult)
	assert.Equal(t, uint64(1), hook.Runs, "a request given up is no run of its own")
	assert.Equal(t, 2, hook.FailuresLastHour)
	assert.Equal(t, map[string]uint64{"ok": 2, "retry": 1}, rep.Jobs)
	require.NotNil(t, rep.LastError)
	assert.Equal(t, "hook", rep.LastError.Rule)
	assert.Equal(t, "500 from hook.example", rep.LastError.Text)

	// 15 minutes on, the first failure (50 minutes before the second read) is out of the hour.
	c.add(15 * time.Minute)
	r.Fill(&rep)
	assert.Equal(t, 1, rep.RuleStats["rep"].FailuresLastHour)
	assert.Equal(t, uint64(2), rep.RuleStats["rep"].Failures)
	c.add(2 * time.Hour)
	r.Fill(&rep)
	assert.Zero(t, rep.RuleStats["rep"].FailuresLastHour)
	assert.Zero(t, rep.RuleStats["hook"].FailuresLastHour)

	b, err := json.Marshal(rep)
	require.NoError(t, err)
	assert.NotContains(t, string(b), "S3CRET")

	// A day of failures, one a minute, counts the last hour's only.
	r.RuleRun("busy", ResultError, errors.New("x"))
	for range 24 * 60 {
		c.add(time.Minute)
		r.RuleRun("busy", ResultError, errors.New("x"))
	}
	r.Fill(&rep)
	assert.Equal(t, 60, rep.RuleStats["busy"].FailuresLastHour)

	var none *Recorder
	none.RuleRun("x", ResultError, errors.New("x"))
	none.GaveUp("x", errors.New("x"))
	none.JobDone("replicate", "ok", 0)
	none.Fill(&rep)
}

func TestRedactCutsLongErrors(t *testing.T) {
	t.Parallel()
	s := redact(strings.Repeat("é", 400) + " http://u:pw@h/")
	assert.LessOrEqual(t, len(s), maxErrorText+len("…"))
	assert.True(t, strings.HasSuffix(s, "…"))
	assert.NotContains(t, s, "\uFFFD")
}

// register adds a service whose answers carry rule stats, stopped when the test ends.
func register(t *testing.T, nc *nats.Conn, prefix, component string) *Service {
	t.Helper()
	rec := NewRecorder()
	rec.RuleRun("rule_"+component, ResultOK, nil)
	svc, err := Register(nc, Config{Prefix: prefix, Component: component, Version: "dev", Report: func(rep *Report) {
		rep.InFlight = 2
		rep.Rules.OnChanges = 1
		rec.Fill(rep)
	}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Stop() })
	return svc
}

// Every process is a micro service: $SRV discovery lists the three components of an
// installation with their instance ids, its status endpoint answers with the process's rule
// stats, and two installations (prefixes) on one NATS do not mix.
func TestServicesDiscoveredAndCollectedPerPrefix(t *testing.T) {
	t.Parallel()
	ns := natstest.Start(t)
	nc, _ := ns.Connect(t)
	other, _ := ns.Connect(t)

	ids := map[string]string{}
	for _, c := range Components {
		ids[register(t, nc, "spiegel", c).ID()] = "spiegel-" + c
	}
	second := register(t, nc, "spiegel", ComponentOnChange)
	ids[second.ID()] = "spiegel-onchange"
	otherID := register(t, other, "staging", ComponentProducer).ID()
	require.NoError(t, nc.Flush())
	require.NoError(t, other.Flush()) // the services' subscriptions are at the server

	// Discovery, as `nats micro list` does it.
	var pings []micro.Ping
	for _, b := range natstest.Answers(t, nc, "$SRV.PING", 5, 5*time.Second) {
		var p micro.Ping
		require.NoError(t, json.Unmarshal(b, &p))
		pings = append(pings, p)
	}
	seen := map[string]string{}
	for _, p := range pings {
		seen[p.ID] = p.Name
		assert.Equal(t, "0.0.0+dev", p.Version)
	}
	want := map[string]string{otherID: "staging-producer"}
	for id, name := range ids {
		want[id] = name
	}
	assert.Equal(t, want, seen)

	// `nats micro info spiegel-producer`
	infos := natstest.Answers(t, nc, "$SRV.INFO.spiegel-producer", 1, 5*time.Second)
	require.Len(t, infos, 1)
	var info micro.Info
	require.NoError(t, json.Unmarshal(infos[0], &info))
	require.Len(t, info.Endpoints, 1)
	assert.Equal(t, "status", info.Endpoints[0].Name)
	assert.Equal(t, "spiegel.svc.producer.status", info.Endpoints[0].Subject)
	assert.Equal(t, "spiegel", info.Metadata["prefix"])
	assert.Equal(t, "dev", info.Metadata["version"])

	reps, err := Collect(t.Context(), nc, "spiegel", 10*time.Second)
	require.NoError(t, err)
	require.Len(t, reps, 4)
	got := map[string]string{}
	for _, r := range reps {
		got[r.ID] = r.Service
		assert.Equal(t, 2, r.InFlight)
		assert.Equal(t, "dev", r.Version)
		assert.Equal(t, ResultOK, r.RuleStats["rule_"+r.Component].LastResult, r.Service)
		assert.NotZero(t, r.Started)
	}
	assert.Equal(t, ids, got)
	assert.True(t, sort.SliceIsSorted(reps, func(i, j int) bool {
		return componentOrder(reps[i].Component) < componentOrder(reps[j].Component)
	}))

	reps, err = Collect(t.Context(), other, "staging", 10*time.Second)
	require.NoError(t, err)
	require.Len(t, reps, 1)
	assert.Equal(t, otherID, reps[0].ID)
	assert.Equal(t, "staging-producer", reps[0].Service)

	// `nats micro stats spiegel-onchange`: the framework's counts, one instance each.
	stats := natstest.Answers(t, nc, "$SRV.STATS.spiegel-onchange."+second.ID(), 1, 5*time.Second)
	require.Len(t, stats, 1)
	var st micro.Stats
	require.NoError(t, json.Unmarshal(stats[0], &st))
	require.Len(t, st.Endpoints, 1)
	assert.Equal(t, 1, st.Endpoints[0].NumRequests)
	assert.Contains(t, string(st.Endpoints[0].Data), `"jobs_in_flight":2`)

	// No instance of an installation: nothing, once the wait is over.
	start := time.Now()
	reps, err = Collect(t.Context(), nc, "nobody", 500*time.Millisecond)
	require.NoError(t, err)
	assert.Empty(t, reps)
	assert.GreaterOrEqual(t, time.Since(start), 500*time.Millisecond)
}
