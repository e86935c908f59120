package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gonum.org/v1/plot/plotter"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

func TestRatio(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "0.50×", ratio(1, 2))
	assert.Equal(t, "∞ (baseline 0)", ratio(3, 0))
	assert.Equal(t, "1 (both 0)", ratio(0, 0))
}

func TestCPUPercent(t *testing.T) {
	t.Parallel()
	got := cpuPercent(plotter.XYs{{X: 0, Y: 1}, {X: 2, Y: 2}, {X: 2, Y: 5}, {X: 3, Y: 3.5}})
	assert.Equal(t, plotter.XYs{{X: 2, Y: 50}, {X: 3, Y: 150}}, got, "an interval of 0 s is skipped")
}

// fakeRun is a run at n dbs whose replication latencies are lat ms, one write a second.
func fakeRun(setup string, baseline bool, n int, lat ...float64) benchdata.Run {
	r := benchdata.Run{Setup: setup, SetupName: setup, Baseline: baseline, Server: "PouchDB Server 4.2.0", DBs: n, DocsPerDB: 10,
		Active: n / 10, Rate: 1, DurationS: float64(len(lat)), InitialSyncS: 2, InitialDocs: 10 * n, ConnsMeasured: true,
		WriterStartS: 5, WriterEndS: 5 + float64(len(lat)), IdleStartS: 20, IdleEndS: 30,
		Requests:     map[string]map[string]int{"replicator": {"POST db/_bulk_docs": len(lat)}},
		IdleRequests: map[string]map[string]int{"replicator": {"GET db": 10}},
		MaxConns:     map[string]int{"replicator": 4}, IdleConns: map[string]int{"replicator": 2}}
	for i, l := range lat {
		hook := -1.0
		if !baseline {
			hook = l / 2
		}
		r.Writes = append(r.Writes, benchdata.Write{AtS: 5 + float64(i), ReplMS: l, HookMS: hook})
	}
	for i := range 30 {
		s := benchdata.Sample{AtS: float64(i), ProxyConns: map[string]int{"replicator": 3}}
		if !baseline {
			s.Procs = map[string]benchdata.Proc{"replicator": {RSSBytes: 10 << 20, CPUSeconds: float64(i) / 10, CouchConns: 3}}
			s.Jobs = map[string]benchdata.Jobs{"replicator": {Pending: uint64(30 - i), InFlight: 1}}
		}
		r.Samples = append(r.Samples, s)
	}
	return r
}

func TestRender(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ours := fakeRun("hot", false, 100, 10, 20, 30, 40)
	base := fakeRun("replicator", true, 100, 20, 40, 60, 80, -1)
	base.MaxConns = map[string]int{"_replicator": 8}
	base.IdleConns = map[string]int{"_replicator": 8}
	base.IdleRequests = map[string]map[string]int{"_replicator": {"GET db/_changes": 40}}
	big := fakeRun("hot", false, 1000, 50)
	bigBase := fakeRun("replicator", true, 1000, 100)
	bigBase.InitialSyncS = -1
	for _, r := range []benchdata.Run{ours, base, big, bigBase} {
		require.NoError(t, benchdata.WriteFile(filepath.Join(dir, benchdata.FileName(r.Setup, r.DBs)), r))
	}
	out := filepath.Join(dir, "out")
	require.NoError(t, run(dir, out, "0.5 0.4 0.3"))
	b, err := os.ReadFile(filepath.Join(out, "report.md"))
	require.NoError(t, err)
	md := string(b)
	// ours at N=100: p50 20 vs 40, max 40 vs 80, delivered 100 % vs 80 %, connections 4 vs 8,
	// idle 1 vs 4 requests/s.
	assert.Contains(t, md, "| 100 | hot | 0.50× | 0.50× | 0.50× | 0.50× | +20.0 pts | 1.00× | 0.50× | 0.25× | 0.25× |")
	assert.Contains(t, md, "| 1000 | hot | 0.50× | 0.50× | 0.50× | 0.50× | +0.0 pts | baseline incomplete |")
	assert.Contains(t, md, "| 4 / 3, 3 / 2 |", "connections: the run's most, while writing (median, most), idle")
	assert.Contains(t, md, "80.0 % / —")
	assert.Contains(t, md, "at the start: 0.5 0.4 0.3")
	for _, f := range []string{"latency-cdf-100", "latency-time-100", "jobs-hot-100", "rss-1000", "cpu-100", "connections-100",
		"connections-vs-n", "idle-requests-vs-n"} {
		assert.Contains(t, md, "]("+f+".png)")
		for _, ext := range []string{".png", ".svg"} {
			st, err := os.Stat(filepath.Join(out, f+ext))
			if assert.NoError(t, err, f+ext) {
				assert.Positive(t, st.Size())
			}
		}
	}
	assert.Less(t, strings.Index(md, "## N = 100"), strings.Index(md, "## N = 1000"))
}
