package main

import (
	"fmt"
	"slices"

	"gonum.org/v1/plot/plotter"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// nCharts draws the charts of one N and returns their PNG file names, in reading order.
func nCharts(n int, runs []benchdata.Run, dir string) ([]string, error) {
	var files []string
	save := func(c *chart, name string) error {
		f, err := c.save(dir, fmt.Sprintf("%s-%d", name, n))
		if err == nil {
			files = append(files, f)
		}
		return err
	}

	cdf := newChart(fmt.Sprintf("Latency CDF, N = %d", n), "latency from the write's answer (ms, log)", "fraction of written docs").logX()
	for _, r := range runs {
		cdf.line(r.Setup+": write→target", cdfXYs(r.Latencies(benchdata.Replication)), false, false)
		if r.Has(benchdata.Webhook) {
			cdf.line(r.Setup+": write→webhook", cdfXYs(r.Latencies(benchdata.Webhook)), true, false)
		}
	}
	cdf.p.Legend.Top, cdf.p.Legend.Left = false, false
	if err := save(cdf, "latency-cdf"); err != nil {
		return nil, err
	}

	overTime := newChart(fmt.Sprintf("Latency over time, N = %d", n), "write time since the writer started (s)", "latency (ms, log)").logY()
	for _, r := range runs {
		overTime.scatter(r.Setup+": write→target", latencyXYs(r, benchdata.Replication))
		if r.Has(benchdata.Webhook) {
			overTime.scatter(r.Setup+": write→webhook", latencyXYs(r, benchdata.Webhook))
		}
	}
	if err := save(overTime, "latency-time"); err != nil {
		return nil, err
	}

	for _, r := range runs {
		if r.Baseline {
			continue
		}
		jobs := newChart(fmt.Sprintf("JetStream jobs, %s, N = %d (grey: writer start, writer end, idle start)", r.Setup, n),
			"time since the pipeline started (s)", "jobs")
		pending := series(r.Samples, jobNames, func(s benchdata.Sample, c string) (float64, bool) {
			j, ok := s.Jobs[c]
			return float64(j.Pending), ok
		})
		inFlight := series(r.Samples, jobNames, func(s benchdata.Sample, c string) (float64, bool) {
			j, ok := s.Jobs[c]
			return float64(j.InFlight), ok
		})
		for _, c := range sortedKeys(pending) {
			jobs.line(c+": pending", pending[c], false, false)
			jobs.line(c+": in flight", inFlight[c], true, false)
		}
		jobs.phases(r)
		if err := save(jobs, "jobs-"+r.Setup); err != nil {
			return nil, err
		}
	}

	rss := newChart(fmt.Sprintf("Resident memory per process, N = %d", n), "time since the setup started (s)", "RSS (MiB)")
	cpu := newChart(fmt.Sprintf("CPU per process, N = %d (100 %% = one core)", n), "time since the setup started (s)", "CPU % per 1 s")
	conns := newChart(fmt.Sprintf("CouchDB connections, N = %d", n), "time since the setup started (s)", "open connections")
	for _, r := range runs {
		rs := series(r.Samples, procNames, func(s benchdata.Sample, p string) (float64, bool) {
			v, ok := s.Procs[p]
			return float64(v.RSSBytes) / (1 << 20), ok
		})
		cs := series(r.Samples, procNames, func(s benchdata.Sample, p string) (float64, bool) {
			v, ok := s.Procs[p]
			return v.CPUSeconds, ok
		})
		for _, p := range sortedKeys(rs) {
			rss.line(r.Setup+": "+p, rs[p], false, false)
			cpu.line(r.Setup+": "+p, cpuPercent(cs[p]), false, false)
		}
		if r.Baseline {
			if r.ConnsMeasured {
				pc := series(r.Samples, func(s benchdata.Sample) []string { return sortedKeys(s.ProxyConns) },
					func(s benchdata.Sample, p string) (float64, bool) { v, ok := s.ProxyConns[p]; return float64(v), ok })
				for _, p := range sortedKeys(pc) {
					conns.line(r.Setup+": "+p+" (proxy count)", pc[p], false, false)
				}
			}
			continue
		}
		pc := series(r.Samples, procNames, func(s benchdata.Sample, p string) (float64, bool) {
			v, ok := s.Procs[p]
			return float64(v.CouchConns), ok && p != "server"
		})
		total := series(r.Samples, func(benchdata.Sample) []string { return []string{"all"} },
			func(s benchdata.Sample, _ string) (float64, bool) {
				n := 0
				for p, v := range s.Procs {
					if p != "server" {
						n += v.CouchConns
					}
				}
				return float64(n), len(s.Procs) > 0
			})
		conns.line(r.Setup+": pipeline total (/proc)", total["all"], false, false)
		for _, p := range sortedKeys(pc) {
			conns.line(r.Setup+": "+p+" (/proc)", pc[p], false, false)
		}
	}
	for _, c := range []struct {
		c    *chart
		name string
	}{{rss, "rss"}, {cpu, "cpu"}, {conns, "connections"}} {
		if c.c.series == 0 {
			continue
		}
		if err := save(c.c, c.name); err != nil {
			return nil, err
		}
	}
	return files, nil
}

// acrossNCharts draws connections and idle requests/s against N, per setup.
func acrossNCharts(runs []benchdata.Run, dir string) ([]string, error) {
	conns := newChart("CouchDB connections against N", "N (user dbs, log)", "connections").logX()
	idle := newChart("CouchDB requests per second while idle, against N", "N (user dbs, log)", "requests/s")
	maxConns, idleConns, idleRate := map[string]plotter.XYs{}, map[string]plotter.XYs{}, map[string]plotter.XYs{}
	names := map[string]string{}
	for _, r := range runs {
		if !r.ConnsMeasured || r.MaxConns == nil {
			continue
		}
		x := float64(r.DBs)
		names[r.Setup] = r.Setup
		maxConns[r.Setup] = append(maxConns[r.Setup], plotter.XY{X: x, Y: float64(benchdata.SumConns(r.MaxConns))})
		idleConns[r.Setup] = append(idleConns[r.Setup], plotter.XY{X: x, Y: float64(benchdata.SumConns(r.IdleConns))})
		idleRate[r.Setup] = append(idleRate[r.Setup], plotter.XY{X: x, Y: r.IdleRate()})
	}
	for _, s := range sortedKeys(names) {
		conns.line(s+": max while writing", maxConns[s], false, true)
		conns.line(s+": open while idle", idleConns[s], true, true)
		idle.line(s, idleRate[s], false, true)
	}
	idle.logX()
	var files []string
	for _, c := range []struct {
		c    *chart
		name string
	}{{conns, "connections-vs-n"}, {idle, "idle-requests-vs-n"}} {
		f, err := c.c.save(dir, c.name)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	return files, nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
