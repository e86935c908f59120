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

func TestAfterUpdates(t *testing.T) {
	t.Parallel()
	f := func(v float64) *float64 { return &v }
	r := Run{Writes: []Write{
		{ReplMS: 600, HookMS: 550, UpdatesMS: f(400)},
		{ReplMS: 30, HookMS: 20, UpdatesMS: f(450)}, // came by a hot feed, before the row
		{ReplMS: 500, HookMS: -1, UpdatesMS: f(300)},
		{ReplMS: 700, HookMS: 650, UpdatesMS: f(-1)}, // no row seen
		{ReplMS: -1, HookMS: 100, UpdatesMS: f(80)},
		{ReplMS: 900, HookMS: 800}, // not measured
	}}
	assert.True(t, r.Has(DBUpdates))
	assert.Equal(t, []float64{400, 450, 300, 80}, r.Latencies(DBUpdates))
	assert.InDelta(t, 4.0/6, r.Delivered(DBUpdates), 1e-9)
	assert.Equal(t, []float64{200, -420, 200}, r.AfterUpdates(Replication))
	assert.Equal(t, []float64{150, -430, 20}, r.AfterUpdates(Webhook))
	assert.False(t, Run{Writes: []Write{{ReplMS: 1, HookMS: 1}}}.Has(DBUpdates), "a record from before the bench followed _db_updates")
	assert.Equal(t, "_db_updates", DBUpdates.String())

	r.DBs, r.SetupName = 10, "hot"
	base := Run{DBs: 10, SetupName: "replicator", Baseline: true, Writes: []Write{{ReplMS: 700, HookMS: -1, UpdatesMS: f(500)}}}
	old := Run{DBs: 10, SetupName: "old", Writes: []Write{{ReplMS: 1, HookMS: 1}}}
	assert.Equal(t, "| N | setup | write→`_db_updates` row, ms (p50 / p95 / p99) | seen | write→target less the row | write→webhook less the row |\n|---|---|---|---|---|---|\n"+
		"| 10 | hot | 300 / 450 / 450 | 66.7 % | 200 / 200 / 200 | 20 / 150 / 150 |\n"+
		"| 10 | replicator | 500 / 500 / 500 | 100.0 % | 200 / 200 / 200 | — |\n", UpdatesTable([]Run{r, old, base}))
	assert.Empty(t, UpdatesTable([]Run{old}))
}

func TestFileRoundTrip(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), FileName("hot", 100))
	updates := 7.5
	want := Run{Setup: "hot", DBs: 100, Writes: []Write{{AtS: 1.5, ReplMS: 12, HookMS: -1, UpdatesMS: &updates}, {AtS: 2, ReplMS: 3, HookMS: 4}},
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
