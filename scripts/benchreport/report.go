package main

import (
	"cmp"
	"fmt"
	"maps"
	"math"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot/plotter"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// machine is what the report says about where it ran.
type machine struct {
	loadStart, loadEnd string
}

// readRuns reads every recorded run in dir, ordered by number of dbs, then ours before the
// baseline.
func readRuns(dir string) ([]benchdata.Run, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "workload-*.json"))
	if err != nil {
		return nil, fmt.Errorf("list runs: %w", err)
	}
	var runs []benchdata.Run
	for _, p := range paths {
		r, err := benchdata.ReadFile(p)
		if err != nil {
			return nil, err
		}
		runs = append(runs, r)
	}
	slices.SortFunc(runs, func(a, b benchdata.Run) int {
		return cmp.Or(cmp.Compare(a.DBs, b.DBs), compareBool(a.Baseline, b.Baseline), cmp.Compare(setupOrder(a.Setup), setupOrder(b.Setup)))
	})
	return runs, nil
}

func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	default:
		return -1
	}
}

func setupOrder(key string) int {
	if i := slices.Index([]string{"hot", "nohot", "capped", "uncapped", "couchdb", "replicator"}, key); i >= 0 {
		return i
	}
	return 99
}

// byN groups runs by number of dbs, in increasing order.
func byN(runs []benchdata.Run) (ns []int, groups map[int][]benchdata.Run) {
	groups = map[int][]benchdata.Run{}
	for _, r := range runs {
		groups[r.DBs] = append(groups[r.DBs], r)
	}
	return slices.Sorted(maps.Keys(groups)), groups
}

// baselineOf returns the baseline run among runs.
func baselineOf(runs []benchdata.Run) (benchdata.Run, bool) {
	for _, r := range runs {
		if r.Baseline {
			return r, true
		}
	}
	return benchdata.Run{}, false
}

// ratio renders ours ÷ base; "—" when it means nothing (no base).
func ratio(ours, base float64) string {
	switch {
	case math.IsNaN(ours) || math.IsNaN(base):
		return "—"
	case base == 0 && ours == 0:
		return "1 (both 0)"
	case base == 0:
		return "∞ (baseline 0)"
	}
	return fmt.Sprintf("%.2f×", ours/base)
}

// latencyCells renders p50 / p95 / p99 / max of latencies in ms.
func latencyCells(ms []float64) string {
	if len(ms) == 0 {
		return "—"
	}
	return fmt.Sprintf("%s / %s / %s / %s ms", num(benchdata.Percentile(ms, 0.5)), num(benchdata.Percentile(ms, 0.95)),
		num(benchdata.Percentile(ms, 0.99)), num(benchdata.Percentile(ms, 1)))
}

// num renders a figure with as many decimals as its size deserves.
func num(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

func syncCell(r benchdata.Run) string {
	if r.InitialSyncS < 0 {
		return fmt.Sprintf("incomplete: %d of %d docs after the limit", r.InitialSyncDocs, r.InitialDocs)
	}
	return fmt.Sprintf("%.1f s", r.InitialSyncS)
}

func connCells(r benchdata.Run) (maxConns, writing, idle string) {
	if !r.ConnsMeasured || r.MaxConns == nil {
		return "not measured", "not measured", "not measured"
	}
	writing = "—"
	if med, most, ok := r.WritingConns(); ok {
		writing = fmt.Sprintf("%d, %d", med, most)
	}
	return fmt.Sprint(benchdata.SumConns(r.MaxConns)), writing, fmt.Sprint(benchdata.SumConns(r.IdleConns))
}

// render writes the charts into dir and returns the report's Markdown.
func render(runs []benchdata.Run, dir string, m machine) (string, error) {
	ns, groups := byN(runs)
	first := runs[0]
	var sb strings.Builder
	sb.WriteString("# End-to-end benchmark report (`make bench-e2e`)\n\n")
	fmt.Fprintf(&sb, "- date: %s\n", first.Started.UTC().Format(time.RFC3339))
	fmt.Fprintf(&sb, "- machine: %d cores, %s; load average (1, 5, 15 min) at the start: %s, at the end: %s\n",
		runtime.NumCPU(), runtime.Version(), orUnknown(m.loadStart), orUnknown(m.loadEnd))
	fmt.Fprintf(&sb, "- server: %s\n", first.Server)
	fmt.Fprintf(&sb, "- workload: N user dbs × %d docs, %d %% active, one writer at %.0f docs/s for %.0f s into random active dbs; "+
		"one pattern replicator rule fanning every user db into one target db, one on_change rule calling a local webhook per change; N = %s\n",
		first.DocsPerDB, 10, first.Rate, first.DurationS, joinInts(ns))
	sb.WriteString("- baseline, measured in the same run: the same replication done the classic way, one continuous replication per user db " +
		"through the server's `_replicator` db (no webhook: `_replicator` has no on_change).\n\n")
	sb.WriteString("Latency runs from the write's answer to the doc on the target's `_changes` feed (write→target) or to the webhook's call " +
		"(write→webhook). Delivered: written docs that arrived within 60 s of the writer's end. Initial sync: from the start, with the N dbs " +
		"already loaded, until the target holds every doc (and the webhook was called for each). Requests and connections are counted by a " +
		"proxy in front of CouchDB per process (the baseline's replications go through one as well when the server is on this machine). " +
		"Idle: the pipeline after every doc arrived, with no writes. Ratios are ours ÷ baseline from the same run: below 1 means ours is " +
		"lower (faster, fewer). Absolute figures move with the machine's load (shown per setup); compare the ratios.\n\n")

	sb.WriteString("## Summary\n\n")
	sb.WriteString("| N | setup | write→target p50 / p95 / p99 / max | write→webhook p50 / p95 / p99 / max | delivered target / webhook | initial sync | " +
		"CouchDB requests per written doc | spiegel-db writes per doc | connections max / while writing (median, max) / idle | idle requests/s | load average start → end |\n" +
		"|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, n := range ns {
		for _, r := range groups[n] {
			hook, delivered := "—", fmt.Sprintf("%.1f %% / —", 100*r.Delivered(benchdata.Replication))
			if r.Has(benchdata.Webhook) {
				hook = latencyCells(r.Latencies(benchdata.Webhook))
				delivered = fmt.Sprintf("%.1f %% / %.1f %%", 100*r.Delivered(benchdata.Replication), 100*r.Delivered(benchdata.Webhook))
			}
			reqs, writes, idle := "not measured", "—", "not measured"
			if r.ConnsMeasured && r.Requests != nil {
				reqs = num(r.PerDoc(benchdata.Total(r.Requests)))
				idle = num(r.IdleRate())
			}
			if !r.Baseline {
				writes = num(r.PerDoc(spiegelWrites(r)))
			}
			mx, wr, id := connCells(r)
			fmt.Fprintf(&sb, "| %d | %s | %s | %s | %s | %s | %s | %s | %s / %s / %s | %s | %s → %s |\n", n, r.SetupName,
				latencyCells(r.Latencies(benchdata.Replication)), hook, delivered, syncCell(r), reqs, writes, mx, wr, id, idle, r.LoadAvgStart, r.LoadAvgEnd)
		}
	}

	var ordered []benchdata.Run
	for _, n := range ns {
		ordered = append(ordered, groups[n]...)
	}
	if t := benchdata.UpdatesTable(ordered); t != "" {
		sb.WriteString("\n## Where the latency goes: `_db_updates`\n\n")
		sb.WriteString("The bench follows the server's `_db_updates` feed as the producer does and times, for each written doc, the first row " +
			"naming its db after the write was sent. Every job the producer starts from that feed waits for that row (CouchDB 3 writes the feed " +
			"in batches, `[global_changes] max_write_delay`, 500 ms by default), so it is the floor for any pipeline driven by the feed; " +
			"a hot feed does not wait for it. The last two columns are each doc's latency less its row's: the pipeline's own part " +
			"(negative where a hot feed was first).\n\n")
		sb.WriteString(t)
	}

	sb.WriteString("\n## Ratios against the baseline (ours ÷ `_replicator`, same run)\n\n")
	sb.WriteString("| N | setup | write→target p50 | p95 | p99 | max | delivered (ours − baseline) | initial sync | max connections | idle connections | idle requests/s |\n" +
		"|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, n := range ns {
		base, ok := baselineOf(groups[n])
		if !ok {
			fmt.Fprintf(&sb, "| %d | no baseline in this run | | | | | | | | | |\n", n)
			continue
		}
		bl := base.Latencies(benchdata.Replication)
		for _, r := range groups[n] {
			if r.Baseline {
				continue
			}
			ol := r.Latencies(benchdata.Replication)
			q := func(p float64) string {
				if len(ol) == 0 || len(bl) == 0 {
					return "—"
				}
				return ratio(benchdata.Percentile(ol, p), benchdata.Percentile(bl, p))
			}
			sync := "—"
			if r.InitialSyncS >= 0 && base.InitialSyncS >= 0 {
				sync = ratio(r.InitialSyncS, base.InitialSyncS)
			} else if base.InitialSyncS < 0 {
				sync = "baseline incomplete"
			}
			mx, idleC, idleR := "—", "—", "—"
			if base.ConnsMeasured {
				mx = ratio(float64(benchdata.SumConns(r.MaxConns)), float64(benchdata.SumConns(base.MaxConns)))
				idleC = ratio(float64(benchdata.SumConns(r.IdleConns)), float64(benchdata.SumConns(base.IdleConns)))
				idleR = ratio(r.IdleRate(), base.IdleRate())
			}
			fmt.Fprintf(&sb, "| %d | %s | %s | %s | %s | %s | %+.1f pts | %s | %s | %s | %s |\n", n, r.SetupName, q(0.5), q(0.95), q(0.99), q(1),
				100*(r.Delivered(benchdata.Replication)-base.Delivered(benchdata.Replication)), sync, mx, idleC, idleR)
		}
	}

	if len(ns) > 1 {
		sb.WriteString("\n## Across N\n\n")
		files, err := acrossNCharts(runs, dir)
		if err != nil {
			return "", err
		}
		for _, f := range files {
			fmt.Fprintf(&sb, "![%s](%s)\n\n", strings.TrimSuffix(f, ".png"), f)
		}
	}
	for _, n := range ns {
		if err := renderN(&sb, n, groups[n], dir); err != nil {
			return "", err
		}
	}
	sb.WriteString("\n## Notes\n\n")
	for _, note := range notes(runs) {
		fmt.Fprintf(&sb, "- %s\n", note)
	}
	return sb.String(), nil
}

func orUnknown(s string) string { return cmp.Or(s, "unknown") }

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, ", ")
}

// spiegelWrites counts the requests that wrote to the spiegel db.
func spiegelWrites(r benchdata.Run) int {
	n := 0
	for _, eps := range r.Requests {
		for ep, c := range eps {
			method, path, _ := strings.Cut(ep, " ")
			if strings.HasPrefix(path, "spiegel-db") && (method == "PUT" || method == "DELETE" ||
				(method == "POST" && strings.HasSuffix(path, "/_bulk_docs"))) {
				n += c
			}
		}
	}
	return n
}

// notes are what a reader must know about the baseline and the figures.
func notes(runs []benchdata.Run) []string {
	out := []string{}
	seen := map[string]bool{}
	for _, r := range runs {
		for _, n := range r.Notes {
			if !seen[n] {
				seen[n] = true
				out = append(out, n)
			}
		}
	}
	if strings.HasPrefix(runs[0].Server, "PouchDB") {
		out = append(out, "On PouchDB Server the baseline is express-pouchdb's `_replicator` daemon (the pouchdb-replicator plugin): one "+
			"continuous `PouchDB.replicate` per `_replicator` doc, inside the server's own process, reaching the server over HTTP "+
			"through the counting proxy. It has no scheduler: every job runs at once.")
	} else {
		out = append(out, "On Apache CouchDB the baseline is its replication scheduler. By default it runs at most `max_jobs` (500) jobs "+
			"at once and swaps `max_churn` (20) of the others in every `interval` (60 s), so with more dbs than `max_jobs` some dbs are "+
			"not replicated continuously: their writes wait for their job's turn.")
	}
	out = append(out, "Process figures come from /proc/<pid>/status (VmRSS) and /proc/<pid>/stat (utime + stime); the pipeline's "+
		"CouchDB connections from its sockets in /proc/<pid>/fd matched to established rows of /proc/net/tcp. The baseline's work happens "+
		"inside the server: its CPU and memory are the \"server\" rows when the bench knew the server's pid (BENCH_SERVER_PID, set when "+
		"bench-e2e starts PouchDB Server itself).")
	return out
}

// renderN writes the section of one N: charts, processes, requests by endpoint.
func renderN(sb *strings.Builder, n int, runs []benchdata.Run, dir string) error {
	fmt.Fprintf(sb, "\n## N = %d\n\n", n)
	files, err := nCharts(n, runs, dir)
	if err != nil {
		return err
	}
	for _, f := range files {
		fmt.Fprintf(sb, "![%s](%s)\n\n", strings.TrimSuffix(f, ".png"), f)
	}
	sb.WriteString("### Processes\n\n| setup | process | peak RSS | CPU time over the run | mean CPU | peak CPU (1 s) | max CouchDB connections (/proc) |\n|---|---|---|---|---|---|---|\n")
	for _, r := range runs {
		for _, name := range procNamesOf(r) {
			st := procStats(r, name)
			conns := fmt.Sprint(st.maxConns)
			if name == "server" {
				conns = "—"
			}
			fmt.Fprintf(sb, "| %s | %s | %.1f MiB | %.2f s | %.1f %% | %.0f %% | %s |\n", r.SetupName, name,
				float64(st.peakRSS)/(1<<20), st.cpu, st.meanPct, st.peakPct, conns)
		}
	}
	for _, r := range runs {
		if r.Requests == nil || !r.ConnsMeasured {
			continue
		}
		fmt.Fprintf(sb, "\n### CouchDB requests per written doc: %s\n\n", r.SetupName)
		sb.WriteString(benchdata.EndpointTable(r))
	}
	return nil
}

func procNamesOf(r benchdata.Run) []string {
	names := map[string]bool{}
	for _, s := range r.Samples {
		for n := range s.Procs {
			names[n] = true
		}
	}
	return slices.Sorted(maps.Keys(names))
}

type procStat struct {
	peakRSS               int64
	cpu, meanPct, peakPct float64
	maxConns              int
}

// procStats sums up one process over a run's samples.
func procStats(r benchdata.Run, name string) procStat {
	var st procStat
	var cum plotter.XYs
	for _, s := range r.Samples {
		p, ok := s.Procs[name]
		if !ok {
			continue
		}
		st.peakRSS = max(st.peakRSS, p.RSSBytes)
		st.maxConns = max(st.maxConns, p.CouchConns)
		cum = append(cum, plotter.XY{X: s.AtS, Y: p.CPUSeconds})
	}
	if len(cum) > 1 {
		st.cpu = cum[len(cum)-1].Y - cum[0].Y
		st.meanPct = 100 * st.cpu / (cum[len(cum)-1].X - cum[0].X)
		for _, p := range cpuPercent(cum) {
			st.peakPct = max(st.peakPct, p.Y)
		}
	}
	return st
}
