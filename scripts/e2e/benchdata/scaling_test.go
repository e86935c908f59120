package benchdata

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestScalingRates(t *testing.T) {
	t.Parallel()
	// 100 jobs: a slow start (10 done at 1 s), 80 more in 2 s, a long tail to 5 s.
	r := ScalingRun{Jobs: 100, Delivered: 1000, DrainS: 5, Progress: []Progress{
		{AtS: 0.5, Done: 0}, {AtS: 1, Done: 10}, {AtS: 2, Done: 50}, {AtS: 3, Done: 90}, {AtS: 5, Done: 100},
	}}
	assert.InDelta(t, 40, r.JobsPerSec(), 1e-9, "10 % → 90 %: 80 jobs in 2 s")
	assert.InDelta(t, 20, r.DrainJobsPerSec(), 1e-9)
	assert.InDelta(t, 400, r.DocsPerSec(), 1e-9, "10 docs a job")
	assert.InDelta(t, 0.5, r.CoresOf(2.5), 1e-9)

	r.ServerCPUS, r.ServerBeforeCores = 3, 0.2 // 3 s over the 5 s drain, 1 s of it at the rate before
	perJob, ok := r.ServerCPUPerJob()
	assert.True(t, ok)
	assert.InDelta(t, 0.02, perJob, 1e-9, "2 s of the server's CPU for 100 jobs")
	r.ServerBeforeCores = 0.7
	_, ok = r.ServerCPUPerJob()
	assert.False(t, ok, "no more than before: unknown")

	coarse := ScalingRun{Jobs: 100, DrainS: 4, Progress: []Progress{{AtS: 1, Done: 20}, {AtS: 2, Done: 95}}}
	assert.InDelta(t, 25, coarse.JobsPerSec(), 1e-9, "no poll between 10 % and 90 %: the whole drain")
	assert.Zero(t, ScalingRun{Jobs: 10}.JobsPerSec())
}

func TestScalingFile(t *testing.T) {
	t.Parallel()
	r := ScalingRun{Group: "onchange", Procs: 2, Round: 1, DBs: 200, Jobs: 200, ProcCPUS: []float64{1, 2}, ServerCPUS: -1}
	path := filepath.Join(t.TempDir(), ScalingFileName(r.Group, r.Procs, r.DBs, r.Round))
	assert.Equal(t, "scaling-onchange-2-200-r1.json", filepath.Base(path))
	require.NoError(t, WriteScalingFile(path, r))
	got, err := ReadScalingFile(path)
	require.NoError(t, err)
	assert.Equal(t, r, got)
}
