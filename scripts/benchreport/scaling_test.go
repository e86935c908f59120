package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// fakeScaling is a run of group with k processes draining 100 jobs at jobsPerSec, steadily, with
// the server using serverCores and the machine busy.
func fakeScaling(group string, k, round int, jobsPerSec, serverCores, busy float64) benchdata.ScalingRun {
	drain := 100 / jobsPerSec
	r := benchdata.ScalingRun{Group: group, Procs: k, Round: round, Server: "Apache CouchDB 3.3.3", DBs: 100, DocsPerDB: 10,
		Jobs: 100, JobsRun: 100, Delivered: 1000, Started: time.Unix(0, 0), LoadAvgStart: "1.00 1.00 1.00", LoadAvgEnd: "2.00 1.00 1.00",
		Cores: 2, DrainS: drain, ServerCPUS: serverCores * drain, ServerBeforeCores: 0.1, BenchCPUS: 0.1 * drain, MachineBusy: busy}
	for range k {
		r.ProcCPUS = append(r.ProcCPUS, 0.2*drain)
		r.JobsByProc = append(r.JobsByProc, 100/k)
	}
	for i := 0; i <= 20; i++ {
		r.Progress = append(r.Progress, benchdata.Progress{AtS: float64(i) * drain / 20, Done: i * 5})
	}
	return r
}

func TestScalingSection(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	runs := []benchdata.ScalingRun{
		// replicator, two rounds: k = 1 at 100 and 120 (median: the lower middle, 100), k = 2 at 190,
		// k = 4 at 240 with CouchDB on 1.8 of 2 cores: 2.4× is below 0.8 × 4.
		fakeScaling("replicator", 1, 0, 100, 0.8, 0.5), fakeScaling("replicator", 1, 1, 120, 0.9, 0.5),
		fakeScaling("replicator", 2, 0, 190, 1.4, 0.8), fakeScaling("replicator", 2, 1, 180, 1.4, 0.8),
		fakeScaling("replicator", 4, 0, 240, 1.8, 0.95), fakeScaling("replicator", 4, 1, 250, 1.8, 0.95),
		// onchange scales: 2 processes, 1.9×.
		fakeScaling("onchange", 1, 0, 50, 0.3, 0.3), fakeScaling("onchange", 2, 0, 95, 0.6, 0.5),
	}
	runs[len(runs)-1].JobsRun, runs[len(runs)-1].JobsByResult = 110, map[string]int{"ok": 100, "retry": 10}
	for _, r := range runs {
		require.NoError(t, benchdata.WriteScalingFile(filepath.Join(dir, benchdata.ScalingFileName(r.Group, r.Procs, r.DBs, r.Round)), r))
	}
	out := filepath.Join(dir, "out")
	require.NoError(t, run(dir, out, "0.5 0.4 0.3"), "a report of scaling runs alone")
	b, err := os.ReadFile(filepath.Join(out, "report.md"))
	require.NoError(t, err)
	md := string(b)
	assert.Contains(t, md, "at the start: 0.5 0.4 0.3")
	assert.Contains(t, md, "| 1 | 100 (100–120) | 1000 | 1.00× | 1× |")
	assert.Contains(t, md, "| 2 | 180 (180–190) | 1800 | 1.80× | 2× |")
	assert.Contains(t, md, "| 4 | 240 (240–250) | 2400 | 2.40× | 4× |")
	assert.Contains(t, md, "**replicator stops scaling at k = 4**: 2.40× against 4× linear (below 0.8 × k); CouchDB is saturated: it used 1.80 of the machine's 2 cores.")
	assert.Contains(t, md, "| 50, 50 (110 runs for 100 jobs: ok 100, retry 10) |")
	assert.Contains(t, md, "**onchange scales to k = 2**: 1.90× against 2× linear")
	// CouchDB's CPU per job is cores × drain ÷ 100 jobs, gross, and (cores − 0.1 before) × drain ÷
	// 100 jobs, net. The replicator's six runs, gross: 8, 7.5, 7.37, 7.78, 7.5 and 7.2 ms (median
	// 7.5: 267 jobs/s on 2 cores); net: 7.0, 6.67, 6.84, 7.22, 7.08 and 6.8 ms (median 6.84: 292
	// jobs/s). The consumers: 0.2 cores a process over the drain, 0.2 × k × drain ÷ 100 per job:
	// 2, 1.67, 2.1, 2.2, 3.3 and 3.2 ms, median 2.1 ms.
	assert.Contains(t, md, "CouchDB spent 7.5 ms of CPU per job, 6.8 ms less what it spent")
	assert.Contains(t, md, "the consumer processes 2.1 ms together")
	assert.Contains(t, md, "CouchDB could serve 267–292 jobs/s of this group: linear scaling from k = 1 (100 jobs/s a process) would reach that at k ≈ 2.7–2.9")
	assert.Contains(t, md, "| 1.40 cores (0.10 before) | 0.20 / 0.20 | 0.10 | 80 % | 50, 50 | 1000 of 1000 docs | 1.00 1.00 1.00 → 2.00 1.00 1.00 |")
	assert.Less(t, strings.Index(md, "### replicator processes"), strings.Index(md, "### onchange processes"))
	for _, f := range []string{"scaling-replicator-100", "scaling-cpu-replicator-100", "scaling-onchange-100", "scaling-cpu-onchange-100"} {
		assert.Contains(t, md, "]("+f+".png)")
		for _, ext := range []string{".png", ".svg"} {
			st, err := os.Stat(filepath.Join(out, f+ext))
			if assert.NoError(t, err, f+ext) {
				assert.Positive(t, st.Size())
			}
		}
	}
}

func TestSaturationCause(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		run   benchdata.ScalingRun
		short string
	}{
		{"CouchDB", fakeScaling("replicator", 2, 0, 100, 1.7, 0.9), "CouchDB saturated, 1.70 of 2 cores"},
		{"machine", fakeScaling("replicator", 2, 0, 100, 0.9, 0.97), "machine saturated, 97 % busy"},
		{"unknown server", func() benchdata.ScalingRun {
			r := fakeScaling("onchange", 2, 0, 100, 0, 0.5)
			r.ServerCPUS = -1
			return r
		}(), "CouchDB's CPU unknown"},
		{"elsewhere", fakeScaling("onchange", 2, 0, 100, 0.5, 0.5), "neither CouchDB nor the machine at its limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			short, why := saturationCause(tc.run)
			assert.Equal(t, tc.short, short)
			assert.NotEmpty(t, why)
		})
	}
}
