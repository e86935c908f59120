package main

import (
	"cmp"
	"fmt"
	"image/color"
	"maps"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// The horizontal scaling section: runs of BenchmarkScaling (scaling-<group>-<k>-<dbs>.json).

// scalingEfficiencyFloor is the speedup, as a fraction of linear, below which a group is said to
// have stopped scaling at that number of processes.
const scalingEfficiencyFloor = 0.8

// scalingBusyFloor is the share of the cores (CouchDB's alone, or the whole machine's) from which
// it is said to be saturated.
const scalingBusyFloor = 0.8

// readScalingRuns reads every scaling run in dir, ordered by number of dbs, group (replicator
// first), processes and round.
func readScalingRuns(dir string) ([]benchdata.ScalingRun, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "scaling-*.json"))
	if err != nil {
		return nil, fmt.Errorf("list scaling runs: %w", err)
	}
	var runs []benchdata.ScalingRun
	for _, p := range paths {
		r, err := benchdata.ReadScalingFile(p)
		if err != nil {
			return nil, err
		}
		runs = append(runs, r)
	}
	slices.SortFunc(runs, func(a, b benchdata.ScalingRun) int {
		return cmp.Or(cmp.Compare(a.DBs, b.DBs), cmp.Compare(scalingGroupOrder(a.Group), scalingGroupOrder(b.Group)), cmp.Compare(a.Procs, b.Procs), cmp.Compare(a.Round, b.Round))
	})
	return runs, nil
}

func scalingGroupOrder(g string) int {
	if g == "replicator" {
		return 0
	}
	return 1
}

// scalingPoint is one number of processes of a curve: its runs, one per round.
type scalingPoint struct {
	procs int
	runs  []benchdata.ScalingRun // by increasing jobs/s
}

// rep is the run of median throughput (the lower middle one of an even count): its figures
// stand for the point.
func (p scalingPoint) rep() benchdata.ScalingRun { return p.runs[(len(p.runs)-1)/2] }

func (p scalingPoint) jobsPerSec() float64 { return p.rep().JobsPerSec() }

// spread renders the lowest and highest throughput of the rounds ("" for one round).
func (p scalingPoint) spread() string {
	if len(p.runs) < 2 {
		return ""
	}
	return fmt.Sprintf(" (%s–%s)", num(p.runs[0].JobsPerSec()), num(p.runs[len(p.runs)-1].JobsPerSec()))
}

// scalingCurve is one group's runs at one number of dbs, by increasing processes.
type scalingCurve struct {
	group  string
	dbs    int
	points []scalingPoint
}

// scalingCurves groups runs (sorted by readScalingRuns) into curves and points.
func scalingCurves(runs []benchdata.ScalingRun) []scalingCurve {
	var out []scalingCurve
	for _, r := range runs {
		if n := len(out); n == 0 || out[n-1].group != r.Group || out[n-1].dbs != r.DBs {
			out = append(out, scalingCurve{group: r.Group, dbs: r.DBs})
		}
		c := &out[len(out)-1]
		if n := len(c.points); n == 0 || c.points[n-1].procs != r.Procs {
			c.points = append(c.points, scalingPoint{procs: r.Procs})
		}
		pt := &c.points[len(c.points)-1]
		pt.runs = append(pt.runs, r)
	}
	for _, c := range out {
		for _, pt := range c.points {
			slices.SortFunc(pt.runs, func(a, b benchdata.ScalingRun) int { return cmp.Compare(a.JobsPerSec(), b.JobsPerSec()) })
		}
	}
	return out
}

// rounds returns the most rounds of any point.
func (c scalingCurve) rounds() int {
	n := 0
	for _, pt := range c.points {
		n = max(n, len(pt.runs))
	}
	return n
}

// perProc is the throughput of the smallest point divided by its processes: the linear line is
// k times it.
func (c scalingCurve) perProc() float64 {
	return c.points[0].jobsPerSec() / float64(c.points[0].procs)
}

// speedup is a point's throughput over the smallest point's, scaled to k = 1 when the smallest
// has more than one process.
func (c scalingCurve) speedup(pt scalingPoint) float64 {
	if pp := c.perProc(); pp > 0 {
		return pt.jobsPerSec() / pp
	}
	return 0
}

// serverCPUPerJob is the median, over every run of the curve, of the CouchDB server's CPU
// seconds per job: gross is all of its CPU over the drains, net less its CPU at the rate of the
// seconds before each run (other clients of a shared server); ok is false when the server's CPU
// is unknown.
func (c scalingCurve) serverCPUPerJob() (gross, net float64, ok bool) {
	var grosses, nets []float64
	for _, pt := range c.points {
		for _, r := range pt.runs {
			if r.ServerCPUS >= 0 && r.Jobs > 0 {
				grosses = append(grosses, r.ServerCPUS/float64(r.Jobs))
			}
			if v, ok := r.ServerCPUPerJob(); ok {
				nets = append(nets, v)
			}
		}
	}
	if len(grosses) == 0 {
		return 0, 0, false
	}
	gross = benchdata.Percentile(grosses, 0.5)
	net = gross
	if len(nets) > 0 {
		net = min(gross, benchdata.Percentile(nets, 0.5))
	}
	return gross, net, gross > 0
}

// consumerCPUPerJob is the median, over every run of the curve, of the consumer processes' CPU
// seconds per job, all processes together.
func (c scalingCurve) consumerCPUPerJob() float64 {
	var per []float64
	for _, pt := range c.points {
		for _, r := range pt.runs {
			sum := 0.0
			for _, s := range r.ProcCPUS {
				sum += max(0, s)
			}
			if r.Jobs > 0 {
				per = append(per, sum/float64(r.Jobs))
			}
		}
	}
	return benchdata.Percentile(per, 0.5)
}

// ceilings are the most jobs/s CouchDB could serve with every core of the machine at the
// curve's gross and net CPU per job (low ≤ high); ok is false when that is unknown.
func (c scalingCurve) ceilings() (low, high float64, ok bool) {
	gross, net, ok := c.serverCPUPerJob()
	if !ok {
		return 0, 0, false
	}
	cores := float64(c.points[0].rep().Cores)
	return cores / gross, cores / net, true
}

// saturation returns the first run whose speedup is below scalingEfficiencyFloor of linear, and
// why, from the CPU figures; ok is false when every run scales.
func (c scalingCurve) saturation() (at scalingPoint, short, why string, ok bool) {
	for _, pt := range c.points[1:] {
		if c.speedup(pt) >= scalingEfficiencyFloor*float64(pt.procs) {
			continue
		}
		short, why := saturationCause(pt.rep())
		return pt, short, why, true
	}
	return scalingPoint{}, "", "", false
}

// saturationCause says what was at its limit in a run that stopped scaling, in a few words (for
// a chart's legend) and in a sentence.
func saturationCause(r benchdata.ScalingRun) (short, why string) {
	server := r.CoresOf(r.ServerCPUS)
	switch {
	case r.ServerCPUS >= 0 && server >= scalingBusyFloor*float64(r.Cores):
		return fmt.Sprintf("CouchDB saturated, %.2f of %d cores", server, r.Cores),
			fmt.Sprintf("CouchDB is saturated: it used %.2f of the machine's %d cores", server, r.Cores)
	case r.MachineBusy >= scalingBusyFloor:
		why := fmt.Sprintf("the machine is saturated: its %d cores were %s busy (anyone's work included)", r.Cores, busyText(r.MachineBusy))
		if r.ServerCPUS >= 0 {
			why += fmt.Sprintf(", CouchDB used %.2f cores", server)
		}
		return fmt.Sprintf("machine saturated, %s busy", busyText(r.MachineBusy)), why
	case r.ServerCPUS < 0:
		return "CouchDB's CPU unknown", fmt.Sprintf("CouchDB's CPU is unknown (no BENCH_SERVER_PID); the machine was %s busy", busyText(r.MachineBusy))
	default:
		return "neither CouchDB nor the machine at its limit", fmt.Sprintf("neither CouchDB (%.2f cores) nor the machine (%s busy) is at its limit: "+
			"the limit is elsewhere (requests waiting on CouchDB's disk or locks, the work stream)", server, busyText(r.MachineBusy))
	}
}

// scalingSection renders the horizontal scaling section and draws its charts into dir.
func scalingSection(runs []benchdata.ScalingRun, dir string) (string, error) {
	var sb strings.Builder
	first := runs[0]
	sb.WriteString("\n## Horizontal scaling: consumer processes draining a backlog\n\n")
	fmt.Fprintf(&sb, "Server: %s. Each run starts from a fixed backlog of one job per user db (N dbs × %d docs, loaded once), "+
		"stored by the producer for one rule of one group (a pattern replicator rule into a fresh target db, or an on_change rule "+
		"calling a local webhook per change) while no consumer ran; the producer then stops, and k processes of that group start "+
		"at once and drain it, talking to CouchDB directly. The other group has no rule and no process. Jobs/s is the group's "+
		"throughput while the backlog went from 10 %% to 90 %% done (polled every 50 ms from the JetStream consumer), which leaves "+
		"out the processes' start and the last jobs' tail; the whole drain's rate is beside it. Speedup is jobs/s over k = %d's "+
		"(per process), linear is k×. CPU is /proc's, over the drain, in cores (1 = one core busy throughout): CouchDB's "+
		"server process (and, in brackets, in the 2 s before the run, when no job ran: what other clients cost it), each consumer process (its start included), the bench process (the embedded NATS server and the webhook "+
		"sink), and the machine's busy share of all its cores, other users' work included. A group stops scaling at the first k "+
		"whose speedup is below %.1f × k; the report says what was saturated there (CouchDB at %.0f %% of the cores or more, "+
		"else the machine at %.0f %% busy or more). Concurrency per process: %s.\n\n",
		first.Server, first.DocsPerDB, first.Procs, scalingEfficiencyFloor, 100*scalingBusyFloor, 100*scalingBusyFloor, concurrencyText(first.Concurrency))
	for _, c := range scalingCurves(runs) {
		fmt.Fprintf(&sb, "### %s processes, N = %d\n\n", c.group, c.dbs)
		if n := c.rounds(); n > 1 {
			fmt.Fprintf(&sb, "%d rounds, every other one from the most processes down; jobs/s is the median round's (lowest–highest in "+
				"brackets), and the other figures of a row are that round's.\n\n", n)
		}
		sb.WriteString("| k | jobs/s | docs/s | speedup | linear | whole drain | CouchDB CPU | consumer CPU per process | bench CPU | machine busy | jobs per process | delivered | load average start → end |\n" +
			"|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
		for _, pt := range c.points {
			r := pt.rep()
			procCPU := make([]string, len(r.ProcCPUS))
			for i, s := range r.ProcCPUS {
				procCPU[i] = fmt.Sprintf("%.2f", r.CoresOf(s))
			}
			server := "unknown"
			if r.ServerCPUS >= 0 {
				server = fmt.Sprintf("%.2f cores (%.2f before)", r.CoresOf(r.ServerCPUS), r.ServerBeforeCores)
			}
			fmt.Fprintf(&sb, "| %d | %s%s | %s | %.2f× | %d× | %d jobs in %.2f s (%s jobs/s) | %s | %s | %.2f | %s | %s | %d of %d docs | %s → %s |\n",
				r.Procs, num(r.JobsPerSec()), pt.spread(), num(r.DocsPerSec()), c.speedup(pt), r.Procs, r.Jobs, r.DrainS, num(r.DrainJobsPerSec()),
				server, strings.Join(procCPU, " / "), r.CoresOf(r.BenchCPUS), busyText(r.MachineBusy), jobsByProcText(r),
				r.Delivered, r.DBs*r.DocsPerDB, r.LoadAvgStart, r.LoadAvgEnd)
		}
		sb.WriteString("\n")
		if at, _, why, ok := c.saturation(); ok {
			fmt.Fprintf(&sb, "**%s stops scaling at k = %d**: %.2f× against %d× linear (below %.1f × k); %s.\n\n",
				c.group, at.procs, c.speedup(at), at.procs, scalingEfficiencyFloor, why)
		} else {
			last := c.points[len(c.points)-1]
			fmt.Fprintf(&sb, "**%s scales to k = %d**: %.2f× against %d× linear (at or above %.1f × k at every k); CouchDB used %s, the machine was %s busy.\n\n",
				c.group, last.procs, c.speedup(last), last.procs, scalingEfficiencyFloor, serverCoresText(last.rep()), busyText(last.rep().MachineBusy))
		}
		if gross, net, ok := c.serverCPUPerJob(); ok {
			low, high, _ := c.ceilings()
			fmt.Fprintf(&sb, "CouchDB spent %.1f ms of CPU per job, %.1f ms less what it spent at the rate of the 2 s before each run, "+
				"when no job ran (other clients of a shared server; medians of the runs above); the consumer processes %.1f ms together. "+
				"So with all %d cores of this machine CouchDB could serve %s jobs/s of this group", 1000*gross, 1000*net,
				1000*c.consumerCPUPerJob(), c.points[0].rep().Cores, numRange(low, high, num))
			if pp := c.perProc(); pp > 0 {
				fmt.Fprintf(&sb, ": linear scaling from k = 1 (%s jobs/s a process) would reach that at k ≈ %s", num(pp),
					numRange(low/pp, high/pp, func(v float64) string { return fmt.Sprintf("%.1f", v) }))
			}
			sb.WriteString(". The chart draws that ceiling.")
			if strings.HasPrefix(c.points[0].rep().Server, "PouchDB") {
				sb.WriteString(" PouchDB Server runs its JavaScript on one thread, so its own ceiling is nearer one core's worth: about half of that.")
			}
			sb.WriteString("\n\n")
		}
		if first := c.points[0].rep(); first.MachineBusy >= scalingBusyFloor {
			fmt.Fprintf(&sb, "The machine was already %s busy at k = %d: what more processes gain here is bounded by the cores left, not by CouchDB alone.\n\n",
				busyText(first.MachineBusy), first.Procs)
		}
		files, err := scalingCharts(c, dir)
		if err != nil {
			return "", err
		}
		for _, f := range files {
			fmt.Fprintf(&sb, "![%s](%s)\n\n", strings.TrimSuffix(f, ".png"), f)
		}
	}
	return sb.String(), nil
}

func concurrencyText(n int) string {
	if n == 0 {
		return "the product's default (`SPIEGEL_CONCURRENCY` unset)"
	}
	return fmt.Sprintf("`SPIEGEL_CONCURRENCY=%d`", n)
}

func busyText(f float64) string {
	if f < 0 {
		return "unknown"
	}
	return fmt.Sprintf("%.0f %%", 100*f)
}

func serverCoresText(r benchdata.ScalingRun) string {
	if r.ServerCPUS < 0 {
		return "an unknown share of the cores (no BENCH_SERVER_PID)"
	}
	return fmt.Sprintf("%.2f of %d cores", r.CoresOf(r.ServerCPUS), r.Cores)
}

// scalingCharts draws a curve's throughput against k with the linear line and the saturation
// point, and its CPU against k; it returns the PNG file names.
func scalingCharts(c scalingCurve, dir string) ([]string, error) {
	var files []string
	measured, linear, lows, highs := plotter.XYs{}, plotter.XYs{}, plotter.XYs{}, plotter.XYs{}
	for _, pt := range c.points {
		k := float64(pt.procs)
		measured = append(measured, plotter.XY{X: k, Y: pt.jobsPerSec()})
		linear = append(linear, plotter.XY{X: k, Y: c.perProc() * k})
		lows = append(lows, plotter.XY{X: k, Y: pt.runs[0].JobsPerSec()})
		highs = append(highs, plotter.XY{X: k, Y: pt.runs[len(pt.runs)-1].JobsPerSec()})
	}
	jobs := newChart(fmt.Sprintf("%s: jobs/s against processes, N = %d", c.group, c.dbs), "processes (k)", "jobs/s (10 % → 90 % of the backlog)")
	if c.rounds() > 1 {
		jobs.line(fmt.Sprintf("measured, median of %d rounds", c.rounds()), measured, false, true)
		jobs.line("lowest and highest round", lows, true, false)
		jobs.line("", highs, true, false) // the same style as lows: one legend entry for both
	} else {
		jobs.line("measured", measured, false, true)
	}
	lin, err := plotter.NewLine(linear)
	if err != nil {
		return nil, fmt.Errorf("linear line: %w", err)
	}
	lin.Color, lin.Dashes, lin.Width = color.Gray{Y: 110}, []vg.Length{vg.Points(5), vg.Points(3)}, vg.Points(1.5)
	jobs.track(linear)
	jobs.p.Add(lin)
	jobs.p.Legend.Add("linear: k × the first run's jobs/s per process", lin)
	if at, short, _, ok := c.saturation(); ok {
		mark, err := plotter.NewScatter(plotter.XYs{{X: float64(at.procs), Y: at.jobsPerSec()}})
		if err != nil {
			return nil, fmt.Errorf("saturation mark: %w", err)
		}
		mark.GlyphStyle = draw.GlyphStyle{Color: color.RGBA{R: 200, A: 255}, Radius: vg.Points(8), Shape: draw.CrossGlyph{}}
		jobs.p.Add(mark)
		jobs.p.Legend.Add(fmt.Sprintf("stops scaling at k = %d (%s)", at.procs, short), mark)
	}
	if low, high, ok := c.ceilings(); ok {
		for i, y := range []float64{low, high} {
			if i == 1 && high <= low*1.01 {
				break
			}
			xys := plotter.XYs{{X: 0, Y: y}, {X: float64(c.points[len(c.points)-1].procs) + 0.5, Y: y}}
			l, err := plotter.NewLine(xys)
			if err != nil {
				return nil, fmt.Errorf("ceiling line: %w", err)
			}
			l.Color, l.Dashes, l.Width = color.RGBA{R: 200, A: 255}, []vg.Length{vg.Points(2), vg.Points(2)}, vg.Points(1.5)
			jobs.track(xys)
			jobs.p.Add(l)
			if i == 0 {
				jobs.p.Legend.Add(fmt.Sprintf("CouchDB's ceiling: %d cores ÷ its CPU per job (with and without other clients')", c.points[0].rep().Cores), l)
			}
		}
	}
	procTicks(jobs, c.points)
	f, err := jobs.save(dir, fmt.Sprintf("scaling-%s-%d", c.group, c.dbs))
	if err != nil {
		return nil, err
	}
	files = append(files, f)

	cpu := newChart(fmt.Sprintf("%s: CPU against processes, N = %d", c.group, c.dbs), "processes (k)", "cores busy over the drain")
	var server, consumers, machine plotter.XYs
	for _, pt := range c.points {
		r := pt.rep()
		k := float64(r.Procs)
		if r.ServerCPUS >= 0 {
			server = append(server, plotter.XY{X: k, Y: r.CoresOf(r.ServerCPUS)})
		}
		sum := 0.0
		for _, s := range r.ProcCPUS {
			sum += r.CoresOf(s)
		}
		consumers = append(consumers, plotter.XY{X: k, Y: sum})
		if r.MachineBusy >= 0 {
			machine = append(machine, plotter.XY{X: k, Y: r.MachineBusy * float64(r.Cores)})
		}
	}
	cpu.line("CouchDB", server, false, true)
	cpu.line("consumer processes together", consumers, false, true)
	cpu.line(fmt.Sprintf("machine, all users (of %d cores)", c.points[0].rep().Cores), machine, false, true)
	procTicks(cpu, c.points)
	f, err = cpu.save(dir, fmt.Sprintf("scaling-cpu-%s-%d", c.group, c.dbs))
	if err != nil {
		return nil, err
	}
	return append(files, f), nil
}

// scalingOnlyHeader is the report's head when it holds scaling runs only (the workload's head
// says the same otherwise).
func scalingOnlyHeader(runs []benchdata.ScalingRun, m machine) string {
	if len(runs) == 0 {
		return ""
	}
	return fmt.Sprintf("# End-to-end benchmark report (`make bench-e2e`)\n\n- date: %s\n- machine: %d cores, %s; load average (1, 5, 15 min) at the start: %s, at the end: %s\n- server: %s\n",
		runs[0].Started.UTC().Format(time.RFC3339), runtime.NumCPU(), runtime.Version(), orUnknown(m.loadStart), orUnknown(m.loadEnd), runs[0].Server)
}

// procTicks puts the x axis's ticks at the measured numbers of processes, with room either side.
func procTicks(c *chart, points []scalingPoint) {
	var ticks []plot.Tick
	for _, pt := range points {
		ticks = append(ticks, plot.Tick{Value: float64(pt.procs), Label: fmt.Sprint(pt.procs)})
	}
	c.p.X.Tick.Marker = plot.ConstantTicks(ticks)
	c.p.X.Min, c.p.X.Max = 0, float64(points[len(points)-1].procs)+0.5
}

// jobsByProcText renders the jobs each process ran, and, when the processes ran more or fewer
// jobs than the backlog held, how many by result.
func jobsByProcText(r benchdata.ScalingRun) string {
	s := joinInts(r.JobsByProc)
	if r.JobsRun == r.Jobs || len(r.JobsByResult) == 0 {
		return s
	}
	var results []string
	for _, k := range slices.Sorted(maps.Keys(r.JobsByResult)) {
		results = append(results, fmt.Sprintf("%s %d", k, r.JobsByResult[k]))
	}
	return fmt.Sprintf("%s (%d runs for %d jobs: %s)", s, r.JobsRun, r.Jobs, strings.Join(results, ", "))
}

// numRange renders low–high, or one figure when both render the same.
func numRange(low, high float64, f func(float64) string) string {
	if f(low) == f(high) {
		return f(low)
	}
	return f(low) + "–" + f(high)
}
