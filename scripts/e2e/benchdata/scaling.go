package benchdata

import (
	"encoding/json"
	"fmt"
	"os"
	"time"
)

// ScalingRun is what one run of the horizontal scaling benchmark measured (scripts/e2e,
// BenchmarkScaling): a backlog of one job per user db of one group, stored while no consumer
// ran, drained by Procs consumer processes of that group. Times are seconds since Started (the
// moment the first consumer process was started); CPU figures are seconds of CPU time over the
// drain, from /proc.
type ScalingRun struct {
	Group       string `json:"group"` // replicator or onchange
	Procs       int    `json:"procs"`
	Round       int    `json:"round"`       // 0, 1, ...: the sweep over the numbers of processes it belongs to
	Concurrency int    `json:"concurrency"` // SPIEGEL_CONCURRENCY of each process; 0: the product's default
	Server      string `json:"server"`

	DBs       int `json:"dbs"`
	DocsPerDB int `json:"docs_per_db"`
	Jobs      int `json:"jobs"`      // the backlog: jobs pending when the consumers started
	JobsRun   int `json:"jobs_run"`  // jobs the processes ran (spiegel_jobs_total, any result)
	Delivered int `json:"delivered"` // docs on the target (replicator) or at the webhook (onchange) at the end
	// JobsByProc are the jobs each process ran, in start order; JobsByResult all of them by
	// result (ok, retry, delayed, failed). A job runs more than once when it is retried, or when a
	// change came while it waited (a wakeup marker enqueues it again).
	JobsByProc   []int          `json:"jobs_by_proc"`
	JobsByResult map[string]int `json:"jobs_by_result"`

	Started      time.Time `json:"started"`
	LoadAvgStart string    `json:"loadavg_start"`
	LoadAvgEnd   string    `json:"loadavg_end"`
	Cores        int       `json:"cores"`

	// DrainS is the time from the first process's start until no job was pending or in flight.
	DrainS float64 `json:"drain_s"`
	// Progress is the jobs done (acknowledged) over time, polled every 50 ms or so.
	Progress []Progress `json:"progress"`

	// ServerCPUS is the CouchDB server's CPU time over the drain (-1: its process is unknown).
	ServerCPUS float64 `json:"server_cpu_s"`
	// ServerBeforeCores is the server's CPU, in cores, in the seconds before the consumers
	// started (no job ran): what other clients of a shared server cost it meanwhile.
	ServerBeforeCores float64 `json:"server_before_cores"`
	// ProcCPUS is each consumer process's CPU time from its start to the drain's end.
	ProcCPUS []float64 `json:"proc_cpu_s"`
	// BenchCPUS is the bench process's: the embedded NATS server and the webhook sink.
	BenchCPUS float64 `json:"bench_cpu_s"`
	// MachineBusy is the fraction of the machine's CPU time (all cores) spent busy over the
	// drain (/proc/stat: all but idle and iowait), anyone's work included; -1: unknown.
	MachineBusy float64 `json:"machine_busy"`
}

// Progress is one look at the backlog.
type Progress struct {
	AtS  float64 `json:"at_s"`
	Done int     `json:"done"`
}

// JobsPerSec is the group's throughput: the jobs done while the backlog went from 10 % to 90 %
// done, per second, which leaves out the processes' start and the last jobs' tail; the whole
// drain's when the progress is too coarse for that (fewer than two polls in between).
func (r ScalingRun) JobsPerSec() float64 {
	lo, hi := -1, -1
	for i, p := range r.Progress {
		if lo < 0 && p.Done*10 >= r.Jobs {
			lo = i
		}
		if hi < 0 && p.Done*10 >= r.Jobs*9 {
			hi = i
		}
	}
	if lo >= 0 && hi > lo+1 && r.Progress[hi].AtS > r.Progress[lo].AtS {
		return float64(r.Progress[hi].Done-r.Progress[lo].Done) / (r.Progress[hi].AtS - r.Progress[lo].AtS)
	}
	return r.DrainJobsPerSec()
}

// DrainJobsPerSec is the backlog over the whole drain, the processes' start included.
func (r ScalingRun) DrainJobsPerSec() float64 {
	if r.DrainS <= 0 {
		return 0
	}
	return float64(r.Jobs) / r.DrainS
}

// DocsPerSec is the docs a job carries on average times JobsPerSec.
func (r ScalingRun) DocsPerSec() float64 {
	if r.Jobs == 0 {
		return 0
	}
	return r.JobsPerSec() * float64(r.Delivered) / float64(r.Jobs)
}

// ServerCPUPerJob is the server's CPU seconds per job over the drain, less what it spent at the
// rate of the seconds before (other clients); ok is false when unknown or not above that.
func (r ScalingRun) ServerCPUPerJob() (float64, bool) {
	if r.ServerCPUS < 0 || r.Jobs == 0 {
		return 0, false
	}
	net := r.ServerCPUS - r.ServerBeforeCores*r.DrainS
	if net <= 0 {
		return 0, false
	}
	return net / float64(r.Jobs), true
}

// CoresOf returns CPU seconds over the drain as cores in use (1 = one core busy throughout).
func (r ScalingRun) CoresOf(cpuS float64) float64 {
	if r.DrainS <= 0 || cpuS < 0 {
		return 0
	}
	return cpuS / r.DrainS
}

// ScalingFileName is the name under which a scaling run is written.
func ScalingFileName(group string, procs, dbs, round int) string {
	return fmt.Sprintf("scaling-%s-%d-%d-r%d.json", group, procs, dbs, round)
}

// WriteScalingFile writes r as JSON to path.
func WriteScalingFile(path string, r ScalingRun) error {
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("encode scaling run %s/%d: %w", r.Group, r.Procs, err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("write scaling run: %w", err)
	}
	return nil
}

// ReadScalingFile reads a run written by WriteScalingFile.
func ReadScalingFile(path string) (ScalingRun, error) {
	var r ScalingRun
	b, err := os.ReadFile(path)
	if err != nil {
		return r, fmt.Errorf("read scaling run: %w", err)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("decode scaling run %s: %w", path, err)
	}
	return r, nil
}
