package main

import (
	"fmt"
	"image/color"
	"maps"
	"math"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// minMS is where latencies are drawn when they are below it: log axes cannot show 0.
const minMS = 1

// chart is one figure being drawn; add series, then save.
type chart struct {
	p        *plot.Plot
	series   int
	ylo, yhi float64 // of the data so far
	err      error
}

func newChart(title, x, y string) *chart {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = x
	p.Y.Label.Text = y
	p.Legend.Top = true
	p.Legend.Left = true
	p.Add(plotter.NewGrid())
	return &chart{p: p, ylo: math.Inf(1), yhi: math.Inf(-1)}
}

func (c *chart) logX() *chart {
	c.p.X.Scale = plot.LogScale{}
	c.p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	return c
}

func (c *chart) logY() *chart {
	c.p.Y.Scale = plot.LogScale{}
	c.p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	return c
}

// style is how a series is drawn: each solid series takes the next color; a dashed one is a
// second measure of the series before it (in flight beside pending, idle beside max) and
// takes its color.
func (c *chart) style(dashed bool) (color.Color, []vg.Length) {
	if dashed && c.series > 0 {
		return plotutil.Color(c.series - 1), []vg.Length{vg.Points(5), vg.Points(3)}
	}
	col := plotutil.Color(c.series)
	c.series++
	if dashed {
		return col, []vg.Length{vg.Points(5), vg.Points(3)}
	}
	return col, nil
}

func (c *chart) line(name string, xys plotter.XYs, dashed, points bool) {
	if c.err != nil || len(xys) == 0 {
		return
	}
	c.track(xys)
	col, dashes := c.style(dashed)
	l, err := plotter.NewLine(xys)
	if err != nil {
		c.err = fmt.Errorf("line %s: %w", name, err)
		return
	}
	l.Color, l.Dashes, l.Width = col, dashes, vg.Points(1.5)
	c.p.Add(l)
	if points {
		s, err := plotter.NewScatter(xys)
		if err != nil {
			c.err = fmt.Errorf("points %s: %w", name, err)
			return
		}
		s.GlyphStyle = draw.GlyphStyle{Color: col, Radius: vg.Points(3), Shape: draw.CircleGlyph{}}
		c.p.Add(s)
		c.p.Legend.Add(name, l, s)
		return
	}
	if name != "" { // a series without a name shares the legend entry of the one before it
		c.p.Legend.Add(name, l)
	}
}

func (c *chart) scatter(name string, xys plotter.XYs) {
	if c.err != nil || len(xys) == 0 {
		return
	}
	c.track(xys)
	col, _ := c.style(false)
	s, err := plotter.NewScatter(xys)
	if err != nil {
		c.err = fmt.Errorf("scatter %s: %w", name, err)
		return
	}
	s.GlyphStyle = draw.GlyphStyle{Color: col, Radius: vg.Points(1.5), Shape: draw.CircleGlyph{}}
	c.p.Add(s)
	c.p.Legend.Add(name, s)
}

// phases marks the writer's start and end and the idle phase's start as grey dashed vertical
// lines across the data's y range; call it after the series.
func (c *chart) phases(r benchdata.Run) {
	if c.err != nil || c.ylo > c.yhi {
		return
	}
	for _, x := range []float64{r.WriterStartS, r.WriterEndS, r.IdleStartS} {
		l, err := plotter.NewLine(plotter.XYs{{X: x, Y: c.ylo}, {X: x, Y: c.yhi}})
		if err != nil {
			c.err = fmt.Errorf("phase line: %w", err)
			return
		}
		l.Color = color.Gray{Y: 160}
		l.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
		c.p.Add(l)
	}
}

// track widens the chart's y range by xys.
func (c *chart) track(xys plotter.XYs) {
	for _, p := range xys {
		c.ylo, c.yhi = min(c.ylo, p.Y), max(c.yhi, p.Y)
	}
}

// headroom starts a linear y axis at 0 when the data are not negative and leaves room above the
// data for the legend, which sits in the top corner.
func (c *chart) headroom() {
	if c.ylo > c.yhi || !c.p.Legend.Top {
		return
	}
	if _, log := c.p.Y.Scale.(plot.LogScale); log {
		c.p.Y.Max = max(c.p.Y.Max, c.yhi*8)
		return
	}
	if c.ylo >= 0 {
		c.p.Y.Min = 0
	}
	c.p.Y.Max = max(c.p.Y.Max, c.yhi*1.45, 1)
}

// save writes the chart as PNG and SVG into dir and returns the PNG's file name.
func (c *chart) save(dir, name string) (string, error) {
	if c.err != nil {
		return "", c.err
	}
	c.headroom()
	for _, ext := range []string{".png", ".svg"} {
		if err := c.p.Save(9*vg.Inch, 4.5*vg.Inch, filepath.Join(dir, name+ext)); err != nil {
			return "", fmt.Errorf("save %s%s: %w", name, ext, err)
		}
	}
	return name + ".png", nil
}

// cdfXYs is the CDF of latencies (ms) as points, each latency at least minMS.
func cdfXYs(ms []float64) plotter.XYs {
	values, fractions := benchdata.CDF(ms)
	xys := make(plotter.XYs, len(values))
	for i := range values {
		xys[i] = plotter.XY{X: max(values[i], minMS), Y: fractions[i]}
	}
	return xys
}

// latencyXYs are the latencies of a run's writes over time since the writer started.
func latencyXYs(r benchdata.Run, k benchdata.Kind) plotter.XYs {
	var xys plotter.XYs
	for _, w := range r.Writes {
		v := w.ReplMS
		if k == benchdata.Webhook {
			v = w.HookMS
		}
		if v >= 0 {
			xys = append(xys, plotter.XY{X: w.AtS - r.WriterStartS, Y: max(v, minMS)})
		}
	}
	return xys
}

// series returns, per name, one value of every sample that has it, over time.
func series(samples []benchdata.Sample, names func(benchdata.Sample) []string, value func(benchdata.Sample, string) (float64, bool)) map[string]plotter.XYs {
	out := map[string]plotter.XYs{}
	for _, s := range samples {
		for _, n := range names(s) {
			if v, ok := value(s, n); ok {
				out[n] = append(out[n], plotter.XY{X: s.AtS, Y: v})
			}
		}
	}
	return out
}

func procNames(s benchdata.Sample) []string { return slices.Sorted(maps.Keys(s.Procs)) }

func jobNames(s benchdata.Sample) []string { return slices.Sorted(maps.Keys(s.Jobs)) }

// cpuPercent turns cumulative CPU seconds over time into the CPU % of each interval (100 % is
// one core), at the interval's end.
func cpuPercent(cum plotter.XYs) plotter.XYs {
	var out plotter.XYs
	for i, prev := 1, 0; i < len(cum); i++ {
		dt := cum[i].X - cum[prev].X
		if dt <= 0 {
			continue // a sample taken at the same time: measure from the earlier one
		}
		out = append(out, plotter.XY{X: cum[i].X, Y: 100 * (cum[i].Y - cum[prev].Y) / dt})
		prev = i
	}
	return out
}
