package e2e

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// What the initial sync costs, for the bench's log: the requests of each process by endpoint
// (per db synced), the CPU of each process, of the bench process (counting proxies, embedded
// NATS, webhook sink) and of the CouchDB server, and the work queues over time. With
// BENCH_PPROF set (a duration, e.g. 60s) each process serves its profiling endpoints
// (SPIEGEL_PPROF_ADDR) and a CPU profile of that length is taken of each, all at once,
// BENCH_PPROF_AFTER (20s) into the initial sync, into BENCH_REPORT_DIR (or the working
// directory) as <setup>-<process>.cpu.pprof.

// pprofVars returns SPIEGEL_PPROF_ADDR for a process when BENCH_PPROF asks for profiles.
func pprofVars(b testing.TB) []string {
	if os.Getenv("BENCH_PPROF") == "" {
		return nil
	}
	return []string{"SPIEGEL_PPROF_ADDR=" + freeAddr(b)}
}

// pprofAddr returns the profiling address a process was started with ("" for none).
func pprofAddr(p *proc) string {
	for _, kv := range p.cmd.Env {
		if v, ok := strings.CutPrefix(kv, "SPIEGEL_PPROF_ADDR="); ok {
			return v
		}
	}
	return ""
}

// startSyncProfiles takes the CPU profiles BENCH_PPROF asks for, in the background.
func startSyncProfiles(ctx context.Context, b testing.TB, setup string, procs []*proc) {
	v := os.Getenv("BENCH_PPROF")
	if v == "" {
		return
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < time.Second {
		b.Fatalf("BENCH_PPROF=%q: want a duration of at least 1s", v)
	}
	after := 20 * time.Second
	if v := os.Getenv("BENCH_PPROF_AFTER"); v != "" {
		if after, err = time.ParseDuration(v); err != nil {
			b.Fatalf("BENCH_PPROF_AFTER=%q: want a duration", v)
		}
	}
	dir := cmp.Or(os.Getenv("BENCH_REPORT_DIR"), ".")
	for _, p := range procs {
		addr := pprofAddr(p)
		if addr == "" {
			continue
		}
		go func() {
			select {
			case <-ctx.Done():
				return
			case <-time.After(after):
			}
			url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, int(d.Seconds()))
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				b.Logf("%s: CPU profile of %s: %v", setup, p.name, err)
				return
			}
			defer resp.Body.Close()
			data, err := io.ReadAll(resp.Body)
			if err != nil || resp.StatusCode != http.StatusOK {
				b.Logf("%s: CPU profile of %s: %d %v", setup, p.name, resp.StatusCode, err)
				return
			}
			name := filepath.Join(dir, fmt.Sprintf("%s-%s.cpu.pprof", setup, p.name))
			if err := os.WriteFile(name, data, 0o644); err != nil {
				b.Logf("%s: CPU profile of %s: %v", setup, p.name, err)
				return
			}
			b.Logf("%s: CPU profile of %s (%v from %v into the sync): %s", setup, p.name, d, after, name)
		}()
	}
}

// cpuMark is the CPU used so far by each process of a setup, the bench's own and the server's.
type cpuMark struct {
	at          time.Time
	cpu         map[string]float64
	busy, total float64 // the machine's, from /proc/stat, in ticks
}

func markCPU(procs []*proc, serverPID int) cpuMark {
	m := cpuMark{at: time.Now(), cpu: map[string]float64{}}
	for _, p := range procs {
		if st, err := readProc(p.cmd.Process.Pid, 0); err == nil {
			m.cpu[p.name] = st.CPUSeconds
		}
	}
	if serverPID > 0 {
		if st, err := readProc(serverPID, 0); err == nil {
			m.cpu["couchdb"] = st.CPUSeconds
		}
	}
	if st, err := readProc(os.Getpid(), 0); err == nil {
		m.cpu["bench"] = st.CPUSeconds
	}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		for i, f := range strings.Fields(line)[1:] {
			n, _ := strconv.ParseFloat(f, 64)
			m.total += n
			if i != 3 && i != 4 { // idle, iowait
				m.busy += n
			}
		}
	}
	return m
}

// logSyncCost logs what the initial sync of dbs took: requests per process and endpoint, the
// sweep's questions to CouchDB, CPU, and the work queues every 10 s from the samples; with BENCH_REPORT_DIR also into
// sync-<setup>-<dbs>.txt there (a benchmark's log is cut after a few lines).
func logSyncCost(b testing.TB, setup string, dbs int, from, to cpuMark, counts map[string]proxySnapshot, samples []benchdata.Sample, sweep string) {
	secs := to.at.Sub(from.at).Seconds()
	var sb strings.Builder
	fmt.Fprintf(&sb, "%s: initial sync cost over %.1f s (load average now %s)\n", setup, secs, loadAvg())
	total := 0
	for _, name := range slices.Sorted(maps.Keys(counts)) {
		eps := counts[name].counts
		n := 0
		for _, c := range eps {
			n += c
		}
		total += n
		fmt.Fprintf(&sb, "  %s: %d requests (%.2f per db), most connections %d\n", name, n, float64(n)/float64(dbs), counts[name].maxConns)
		for _, ep := range slices.Sorted(maps.Keys(eps)) {
			fmt.Fprintf(&sb, "    %-40s %8d  %.3f per db\n", ep, eps[ep], float64(eps[ep])/float64(dbs))
		}
	}
	if len(counts) == 0 {
		fmt.Fprintf(&sb, "  requests: not counted (no counting proxies)\n")
	} else {
		fmt.Fprintf(&sb, "  all: %d requests, %.2f per db, %.0f per second\n", total, float64(total)/float64(dbs), float64(total)/secs)
	}
	if sweep != "" {
		fmt.Fprintf(&sb, "  the sweep's questions to CouchDB (spiegel_sweep_checks_total, since the producer started): %s\n", sweep)
	}
	for _, name := range slices.Sorted(maps.Keys(to.cpu)) {
		d := to.cpu[name] - from.cpu[name]
		fmt.Fprintf(&sb, "  CPU %-10s %7.1f s  %.2f cores  %.2f ms per db\n", name, d, d/secs, 1000*d/float64(dbs))
	}
	if t := to.total - from.total; t > 0 {
		fmt.Fprintf(&sb, "  machine busy %.0f %%\n", 100*(to.busy-from.busy)/t)
	}
	// The queues and the server's CPU every 10 s.
	fmt.Fprintf(&sb, "  t(s)  replicator pending/in-flight  onchange pending/in-flight  couchdb cores  replicator cores  onchange cores  producer cores\n")
	var prev *benchdata.Sample
	for i := range samples {
		s := &samples[i]
		if prev != nil && s.AtS-prev.AtS < 10 && i != len(samples)-1 {
			continue
		}
		rate := func(name string) float64 {
			if prev == nil || s.AtS <= prev.AtS {
				return 0
			}
			return (s.Procs[name].CPUSeconds - prev.Procs[name].CPUSeconds) / (s.AtS - prev.AtS)
		}
		r, o := s.Jobs["replicator"], s.Jobs["onchange"]
		fmt.Fprintf(&sb, "  %5.0f  %8d/%-4d                   %8d/%-4d                 %.2f           %.2f              %.2f            %.2f\n",
			s.AtS, r.Pending, r.InFlight, o.Pending, o.InFlight, rate("server"), rate("replicator"), rate("onchange"), rate("producer"))
		prev = s
	}
	b.Log(sb.String())
	if dir := os.Getenv("BENCH_REPORT_DIR"); dir != "" {
		name := filepath.Join(dir, fmt.Sprintf("sync-%s-%d.txt", setup, dbs))
		if err := os.WriteFile(name, []byte(sb.String()), 0o644); err != nil {
			b.Logf("write %s: %v", name, err)
		}
	}
}
