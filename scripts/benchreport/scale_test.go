package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeScalePoint is a point at n dbs whose heap grows by perDB bytes per db over fixed bytes.
func fakeScalePoint(n int, fixed, perDB float64) scalePoint {
	heap := (fixed + perDB*float64(n)) / float64(n)
	return scalePoint{
		DBs: n, Consumers: 1, LoadAvg: [2]string{"1.00", "2.00"}, EventsPerSec: 20000, JobsPerSec: 2000,
		HeapPerDB:  map[string]float64{"published": heap, "settled": heap, "deleted": heap},
		LivePerDB:  map[string]float64{"published": heap, "settled": heap, "deleted": heap},
		NATSRSSMiB: map[string]float64{"start": 18, "published": 30, "settled": 40, "deleted": 35},
		Goroutines: map[string]int{"start": 8, "published": 23, "settled": 56, "deleted": 62, "stopped": 4},
		APIPerJob:  map[string]float64{"STREAM.MSG.GET": 1, "CONSUMER.MSG.NEXT": 0.28}, APIPerJobTotal: 1.28,
		MsgsPerJob: map[string]float64{"ACK +ACK": 1},
		Changed:    scaleChangedFigures{DBs: n / 10, APIPerDB: 4.25, API: map[string]int{"STREAM.MSG.DELETE": n / 10}},
		Sweep:      scaleSweepFigures{Seconds: 1, API: map[string]int{"STREAM.INFO": 1}, Couch: map[string]int64{"_dbs_info": int64(n / 100)}},
		Delete:     scaleDeleteFigures{Seconds: 2, API: map[string]int{"STREAM.PURGE": 2 * n}, Left: map[string]scaleLeft{"KV_SPIEGEL_DONE": {Msgs: 3}}},
	}
}

// The scale report draws every chart as PNG and SVG and has one table row per N, in order, with
// the heap added per db from the N before and what NATS kept.
func TestScaleReport(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	rep := scaleReport{Machine: "2 cores", NATS: "process", Points: []scalePoint{
		fakeScalePoint(30000, 1e6, 100), fakeScalePoint(10000, 1e6, 100), fakeScalePoint(100000, 1e6, 100),
	}}
	data, err := json.Marshal(rep)
	require.NoError(t, err)
	in := filepath.Join(dir, "scale.json")
	require.NoError(t, os.WriteFile(in, data, 0o644))
	require.NoError(t, runScale(in, dir))

	for _, name := range []string{"scale-memory", "scale-nats-memory", "scale-goroutines", "scale-api", "scale-throughput", "scale-sweep"} {
		for _, ext := range []string{".png", ".svg"} {
			fi, err := os.Stat(filepath.Join(dir, name+ext))
			require.NoError(t, err)
			assert.Positive(t, fi.Size(), name+ext)
		}
	}
	md, err := os.ReadFile(filepath.Join(dir, "scale.md"))
	require.NoError(t, err)
	var rows []string
	for _, l := range strings.Split(string(md), "\n") {
		if strings.HasPrefix(l, "| 1") || strings.HasPrefix(l, "| 3") {
			rows = append(rows, l)
		}
	}
	require.Len(t, rows, 3)
	assert.True(t, strings.HasPrefix(rows[0], "| 10000 |"), "sorted by N: %s", rows[0])
	assert.True(t, strings.HasPrefix(rows[2], "| 100000 |"))
	assert.Contains(t, rows[1], "| 133 / 133 / 133 | 100 / 100 / 100 |", "the heap added per db from 10,000 to 30,000 dbs")
	assert.Contains(t, rows[2], "| 3 msgs |", "what NATS kept after the deletes")
	assert.Contains(t, rows[2], "| 10000, 4.25 (STREAM.MSG.DELETE 10000), 0 |", "the dbs changed during their job")
	assert.Contains(t, string(md), "10000: 1.00 → 2.00", "the load average of each N")
}

func TestScaleReportRefusesEmpty(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	in := filepath.Join(dir, "scale.json")
	require.NoError(t, os.WriteFile(in, []byte(`{"points":[]}`), 0o644))
	assert.ErrorContains(t, runScale(in, dir), "no figures")
}
