package main

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
)

// scaleReport is the JSON file of the scale simulation (BenchmarkScale in pkg/producer, written
// to SPIEGEL_SCALE_REPORT; make bench-scale): its figures per number of dbs.
type scaleReport struct {
	Machine string       `json:"machine"`
	NATS    string       `json:"nats"`
	Points  []scalePoint `json:"points"`
}

type scalePoint struct {
	DBs            int                 `json:"dbs"`
	Consumers      int                 `json:"consumers"`
	LoadAvg        [2]string           `json:"load_avg"`
	EventsPerSec   float64             `json:"events_per_s"`
	JobsPerSec     float64             `json:"jobs_per_s"`
	HeapBaseMiB    float64             `json:"heap_base_mib"`
	HeapPerDB      map[string]float64  `json:"heap_bytes_per_db"`
	LivePerDB      map[string]float64  `json:"live_bytes_per_db"`
	NATSRSSMiB     map[string]float64  `json:"nats_rss_mib"`
	Goroutines     map[string]int      `json:"goroutines"`
	APIPerJob      map[string]float64  `json:"api_per_job"`
	APIPerJobTotal float64             `json:"api_per_job_total"`
	MsgsPerJob     map[string]float64  `json:"msgs_per_job"`
	Sweep          scaleSweepFigures   `json:"sweep"`
	Changed        scaleChangedFigures `json:"changed"`
	Delete         scaleDeleteFigures  `json:"delete"`
	APIProducer    map[string]int      `json:"api_producer"`
}

type scaleSweepFigures struct {
	Seconds  float64          `json:"seconds"`
	API      map[string]int   `json:"api"`
	Couch    map[string]int64 `json:"couch_requests"`
	Enqueued int              `json:"enqueued"`
}

// scaleChangedFigures are those of the dbs changed while their job ran (a wakeup marker each).
type scaleChangedFigures struct {
	DBs         int            `json:"dbs"`
	Seconds     float64        `json:"seconds"`
	Runs        int64          `json:"runs"`
	API         map[string]int `json:"api"`
	APIPerDB    float64        `json:"api_per_db"`
	MarkersLeft uint64         `json:"markers_left"`
	JobsLeft    uint64         `json:"jobs_left"`
}

type scaleDeleteFigures struct {
	Seconds float64              `json:"seconds"`
	API     map[string]int       `json:"api"`
	Left    map[string]scaleLeft `json:"left"`
}

type scaleLeft struct {
	Msgs     uint64 `json:"msgs"`
	Subjects uint64 `json:"subjects"`
}

// The moments of the simulation's heap and goroutine figures, in order.
var (
	scaleHeapPhases      = []string{"published", "settled", "deleted"}
	scaleGoroutinePhases = []string{"start", "published", "settled", "deleted", "stopped"}
)

// runScale reads the simulation's figures from in and writes scale.md with its charts into out.
func runScale(in, out string) error {
	data, err := os.ReadFile(in)
	if err != nil {
		return fmt.Errorf("read scale figures: %w", err)
	}
	var rep scaleReport
	if err := json.Unmarshal(data, &rep); err != nil {
		return fmt.Errorf("read scale figures %s: %w", in, err)
	}
	if len(rep.Points) == 0 {
		return fmt.Errorf("no figures in %s", in)
	}
	slices.SortFunc(rep.Points, func(a, b scalePoint) int { return a.DBs - b.DBs })
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", out, err)
	}
	md, err := renderScale(rep, out)
	if err != nil {
		return err
	}
	path := filepath.Join(out, "scale.md")
	if err := os.WriteFile(path, []byte(md), 0o644); err != nil {
		return fmt.Errorf("write scale report: %w", err)
	}
	fmt.Println(path)
	return nil
}

// renderScale draws one chart per figure against the number of dbs and returns the markdown
// that shows them, with the table of figures.
func renderScale(rep scaleReport, dir string) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "# Scale simulation\n\n")
	fmt.Fprintf(&b, "BenchmarkScale (pkg/producer): the producer engine, JetStream and %d consumer job path(s) over a fake CouchDB of N dbs, one on_change pattern rule matching all of them, a handler that does nothing. Machine: %s; NATS server: %s. ",
		rep.Points[0].Consumers, rep.Machine, rep.NATS)
	fmt.Fprintf(&b, "Load average (1 min) at the start and end of each N: %s.\n\n", loadAverages(rep.Points))

	type fig struct {
		name, title, y string
		draw           func(c *chart)
	}
	xs := func(val func(scalePoint) (float64, bool)) plotter.XYs {
		var xys plotter.XYs
		for _, p := range rep.Points {
			if v, ok := val(p); ok {
				xys = append(xys, plotter.XY{X: float64(p.DBs), Y: v})
			}
		}
		return xys
	}
	figs := []fig{
		{"scale-memory", "Memory per db: Go heap in use after a GC (live objects dashed), minus the start", "bytes per db", func(c *chart) {
			for _, ph := range scaleHeapPhases {
				c.line(ph, xs(func(p scalePoint) (float64, bool) { v, ok := p.HeapPerDB[ph]; return v, ok }), false, true)
				c.line(ph+", live", xs(func(p scalePoint) (float64, bool) { v, ok := p.LivePerDB[ph]; return v, ok }), true, true)
			}
		}},
		{"scale-nats-memory", "NATS server RSS per db, minus the start (a server process only)", "bytes per db", func(c *chart) {
			for _, ph := range scaleHeapPhases {
				c.line(ph, xs(func(p scalePoint) (float64, bool) {
					v, ok := p.NATSRSSMiB[ph]
					v0, ok0 := p.NATSRSSMiB["start"]
					return (v - v0) * (1 << 20) / float64(p.DBs), ok && ok0
				}), false, true)
			}
		}},
		{"scale-goroutines", "Goroutines of the process", "goroutines", func(c *chart) {
			for _, ph := range scaleGoroutinePhases {
				c.line(ph, xs(func(p scalePoint) (float64, bool) { v, ok := p.Goroutines[ph]; return float64(v), ok }), false, true)
			}
		}},
		{"scale-api", "JetStream API requests per job (consumer job path), and other messages per job", "per job", func(c *chart) {
			c.line("API requests, total", xs(func(p scalePoint) (float64, bool) { return p.APIPerJobTotal, true }), false, true)
			c.line("API requests per db changed during its job (two runs)", xs(func(p scalePoint) (float64, bool) {
				return p.Changed.APIPerDB, p.Changed.DBs > 0
			}), false, true)
			for _, k := range keysOf(rep.Points, func(p scalePoint) map[string]float64 { return p.APIPerJob }) {
				c.line(k, xs(func(p scalePoint) (float64, bool) { v, ok := p.APIPerJob[k]; return v, ok }), false, true)
			}
			for _, k := range keysOf(rep.Points, func(p scalePoint) map[string]float64 { return p.MsgsPerJob }) {
				c.line(k+" (no API request)", xs(func(p scalePoint) (float64, bool) { v, ok := p.MsgsPerJob[k]; return v, ok }), false, true)
			}
		}},
		{"scale-throughput", "Throughput", "per second", func(c *chart) {
			c.line("feed events/s through the producer", xs(func(p scalePoint) (float64, bool) { return p.EventsPerSec, true }), false, true)
			c.line("jobs/s through the consumer job path", xs(func(p scalePoint) (float64, bool) { return p.JobsPerSec, true }), false, true)
		}},
		{"scale-sweep", "One reconciliation sweep, and the clean-up of N deleted dbs", "seconds", func(c *chart) {
			c.line("sweep", xs(func(p scalePoint) (float64, bool) { return p.Sweep.Seconds, true }), false, true)
			c.line("delete every db (until NATS holds nothing of them)", xs(func(p scalePoint) (float64, bool) { return p.Delete.Seconds, true }), false, true)
		}},
	}
	for _, f := range figs {
		c := newChart(f.title, "dbs", f.y).logX()
		var ticks []plot.Tick
		for _, p := range rep.Points {
			ticks = append(ticks, plot.Tick{Value: float64(p.DBs), Label: fmt.Sprintf("%d", p.DBs)})
		}
		c.p.X.Tick.Marker = plot.ConstantTicks(ticks)
		f.draw(c)
		png, err := c.save(dir, f.name)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(&b, "![%s](%s)\n\n", f.title, png)
	}

	b.WriteString("Heap B/db is the heap in use (live: its live objects) above the start divided by N, fixed costs (connection buffers, the workers) included; " +
		"Δ B/db is the heap added per db from the N before, the cost of one more db.\n\n")
	b.WriteString("| dbs | events/s | jobs/s | heap B/db published / settled / deleted | live B/db published / settled / deleted | Δ heap B/db published / settled / deleted | NATS RSS MiB start / settled / deleted | goroutines start / settled / stopped | API requests per job | other msgs per job | changed during its job: dbs, API per db, markers left | sweep | delete every db | left in NATS after the deletes |\n")
	b.WriteString("|---:|---:|---:|---|---|---|---|---|---|---|---|---|---|---|\n")
	for i, p := range rep.Points {
		delta := "–"
		if i > 0 {
			q := rep.Points[i-1]
			var ds []string
			for _, ph := range scaleHeapPhases {
				d := (p.HeapPerDB[ph]*float64(p.DBs) - q.HeapPerDB[ph]*float64(q.DBs)) / float64(p.DBs-q.DBs)
				ds = append(ds, fmt.Sprintf("%.0f", d))
			}
			delta = strings.Join(ds, " / ")
		}
		rss := "–"
		if len(p.NATSRSSMiB) > 0 {
			rss = fmt.Sprintf("%.0f / %.0f / %.0f", p.NATSRSSMiB["start"], p.NATSRSSMiB["settled"], p.NATSRSSMiB["deleted"])
		}
		left := uint64(0)
		for _, l := range p.Delete.Left {
			left += l.Msgs
		}
		fmt.Fprintf(&b, "| %d | %.0f | %.0f | %.0f / %.0f / %.0f | %.0f / %.0f / %.0f | %s | %s | %d / %d / %d | %.2f (%s) | %s | %d, %.2f (%s), %d | %.2f s, API %s, CouchDB %s | %.1f s, API %s | %d msgs |\n",
			p.DBs, p.EventsPerSec, p.JobsPerSec, p.HeapPerDB["published"], p.HeapPerDB["settled"], p.HeapPerDB["deleted"],
			p.LivePerDB["published"], p.LivePerDB["settled"], p.LivePerDB["deleted"], delta, rss,
			p.Goroutines["start"], p.Goroutines["settled"], p.Goroutines["stopped"],
			p.APIPerJobTotal, floats(p.APIPerJob), floats(p.MsgsPerJob),
			p.Changed.DBs, p.Changed.APIPerDB, ints(p.Changed.API), p.Changed.MarkersLeft,
			p.Sweep.Seconds, ints(p.Sweep.API), ints(p.Sweep.Couch), p.Delete.Seconds, ints(p.Delete.API), left)
	}
	return b.String(), nil
}

func loadAverages(ps []scalePoint) string {
	var out []string
	for _, p := range ps {
		out = append(out, fmt.Sprintf("%d: %s → %s", p.DBs, p.LoadAvg[0], p.LoadAvg[1]))
	}
	return strings.Join(out, "; ")
}

// keysOf returns the keys of every point's map, sorted.
func keysOf(ps []scalePoint, m func(scalePoint) map[string]float64) []string {
	set := map[string]bool{}
	for _, p := range ps {
		for k := range m(p) {
			set[k] = true
		}
	}
	return slices.Sorted(maps.Keys(set))
}

func floats(m map[string]float64) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, fmt.Sprintf("%s %.3g", k, m[k]))
	}
	return strings.Join(out, ", ")
}

func ints[V int | int64](m map[string]V) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, fmt.Sprintf("%s %d", k, m[k]))
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}
