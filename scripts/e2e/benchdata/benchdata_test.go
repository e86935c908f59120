package benchdata

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPercentile(t *testing.T) {
	t.Parallel()
	hundred := make([]float64, 100)
	for i := range hundred {
		hundred[i] = float64(100 - i) // 100 … 1, unsorted on purpose
	}
	for _, tc := range []struct {
		name string
		xs   []float64
		q    float64
		want float64
	}{
		{"none", nil, 0.5, 0},
		{"one", []float64{7}, 0.99, 7},
		{"median of four is the second", []float64{4, 1, 3, 2}, 0.5, 2},
		{"p95 of 1..100", hundred, 0.95, 95},
		{"p99 of 1..100", hundred, 0.99, 99},
		{"max", hundred, 1, 100},
		{"tiny q is the min", hundred, 0.001, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			assert.Equal(t, tc.want, Percentile(tc.xs, tc.q))
		})
	}
	xs := []time.Duration{3, 1, 2}
	assert.Equal(t, time.Duration(2), Percentile(xs, 0.5))
	assert.Equal(t, []time.Duration{3, 1, 2}, xs, "the input is left unsorted")
}

func TestCDF(t *testing.T) {
	t.Parallel()
	values, fractions := CDF([]float64{30, 10, 20, 10})
	assert.Equal(t, []float64{10, 10, 20, 30}, values)
	assert.Equal(t, []float64{0.25, 0.5, 0.75, 1}, fractions)
	values, fractions = CDF(nil)
	assert.Empty(t, values)
	assert.Empty(t, fractions)
}

func TestRunFigures(t *testing.T) {
	t.Parallel()
	r := Run{
		Writes: []Write{
			{AtS: 1, ReplMS: 100, HookMS: 50},
			{AtS: 2, ReplMS: -1, HookMS: 70},
			{AtS: 3, ReplMS: 300, HookMS: -1},
			{AtS: 4, ReplMS: 200, HookMS: -1},
		},
		IdleStartS:   10,
		IdleEndS:     20,
		IdleRequests: map[string]map[string]int{"producer": {"GET /_db_updates": 3}, "replicator": {"GET db": 2}},
	}
	assert.Equal(t, []float64{100, 300, 200}, r.Latencies(Replication))
	assert.Equal(t, []float64{50, 70}, r.Latencies(Webhook))
	assert.InDelta(t, 0.75, r.Delivered(Replication), 1e-9)
	assert.InDelta(t, 0.5, r.Delivered(Webhook), 1e-9)
	assert.InDelta(t, 0.5, r.IdleRate(), 1e-9)
	assert.InDelta(t, 1.25, r.PerDoc(5), 1e-9)
	assert.True(t, r.Has(Webhook))
	r.Baseline = true
	assert.False(t, r.Has(Webhook))
	assert.Zero(t, Run{}.Delivered(Replication))
	assert.Zero(t, Run{}.IdleRate())
}

func TestFileRoundTrip(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), FileName("hot", 100))
	want := Run{Setup: "hot", DBs: 100, Writes: []Write{{AtS: 1.5, ReplMS: 12, HookMS: -1}},
		Samples: []Sample{{AtS: 1, Jobs: map[string]Jobs{"replicator": {Pending: 2, InFlight: 1}}}}}
	require.NoError(t, WriteFile(path, want))
	got, err := ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, want.Writes, got.Writes)
	assert.Equal(t, want.Samples, got.Samples)
	assert.Equal(t, "workload-hot-100.json", filepath.Base(path))
}

func TestEndpointTable(t *testing.T) {
	t.Parallel()
	r := Run{
		Writes:       make([]Write, 4),
		IdleStartS:   0,
		IdleEndS:     2,
		Requests:     map[string]map[string]int{"replicator": {"POST db/_bulk_docs": 2}, "producer": {"GET /_db_updates": 1}},
		IdleRequests: map[string]map[string]int{"producer": {"GET spiegel-db/doc": 4}, "onchange": {"GET db": 2}},
	}
	assert.Equal(t, "| process | endpoint | per doc | while idle, per s |\n|---|---|---|---|\n"+
		"| onchange | `GET db` | 0.00 | 1.00 |\n"+
		"| producer | `GET /_db_updates` | 0.25 | 0.00 |\n"+
		"| producer | `GET spiegel-db/doc` | 0.00 | 2.00 |\n"+
		"| replicator | `POST db/_bulk_docs` | 0.50 | 0.00 |\n", EndpointTable(r))
}
