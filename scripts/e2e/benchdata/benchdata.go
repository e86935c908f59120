// Package benchdata is the record the workload benchmark (scripts/e2e, BenchmarkWorkload) leaves
// for the end-to-end report (scripts/benchreport): what one setup measured at one number of dbs,
// and the statistics both of them compute from it. It does no I/O besides JSON encoding.
package benchdata

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"time"
)

// Run is what one setup of the workload measured at one number of dbs. Times are seconds since
// Started; latencies are milliseconds.
type Run struct {
	Setup     string `json:"setup"` // hot, nohot, couchdb, replicator
	SetupName string `json:"setup_name"`
	// Baseline is true for the server's own _replicator (one continuous replication per db):
	// it has no on_change, and its processes are the server's, not the pipeline's.
	Baseline bool   `json:"baseline"`
	Server   string `json:"server"`

	DBs       int     `json:"dbs"`
	DocsPerDB int     `json:"docs_per_db"`
	Active    int     `json:"active"`
	Rate      float64 `json:"rate"` // docs/s the writer aims at
	DurationS float64 `json:"duration_s"`

	Started      time.Time `json:"started"`
	LoadAvgStart string    `json:"loadavg_start"` // /proc/loadavg when the setup started and ended
	LoadAvgEnd   string    `json:"loadavg_end"`

	// InitialSyncS is the time from the start (dbs loaded, pipeline or _replicator docs not yet
	// there) until the target held every initial doc (and, with on_change, the webhook had been
	// called for each); -1 when that did not happen within the limit, InitialSyncDocs then says
	// how many of InitialDocs were on the target.
	InitialSyncS    float64 `json:"initial_sync_s"`
	InitialDocs     int     `json:"initial_docs"`
	InitialSyncDocs int     `json:"initial_sync_docs"`

	WriterStartS float64 `json:"writer_start_s"`
	WriterEndS   float64 `json:"writer_end_s"`
	IdleStartS   float64 `json:"idle_start_s"`
	IdleEndS     float64 `json:"idle_end_s"`

	Writes []Write `json:"writes"`
	// Requests are the CouchDB requests from the writer's start until every doc arrived (or the
	// drain limit), IdleRequests those of the idle phase; by process, then endpoint.
	Requests     map[string]map[string]int `json:"requests"`
	IdleRequests map[string]map[string]int `json:"idle_requests"`
	// MaxConns is the most CouchDB connections each process held at once while writing (from its
	// counting proxy), IdleConns those open at the end of the idle phase.
	MaxConns  map[string]int `json:"max_conns"`
	IdleConns map[string]int `json:"idle_conns"`
	// ConnsMeasured is false when the baseline's connections could not be counted (a server that
	// is not on this machine cannot reach the counting proxy).
	ConnsMeasured bool `json:"conns_measured"`

	Samples []Sample `json:"samples"`
	Notes   []string `json:"notes,omitempty"`
}

// Write is one doc the writer wrote.
type Write struct {
	AtS    float64 `json:"at_s"`    // when the write was answered
	ReplMS float64 `json:"repl_ms"` // until the doc was on the target's feed; -1: never
	HookMS float64 `json:"hook_ms"` // until the webhook was called for it; -1: never (or baseline)
	// UpdatesMS is the time until the server's _db_updates feed, which the producer follows,
	// named the doc's db after the write was sent: the wait every job started by that feed
	// has; -1: no such row; nil: not measured (records from before the bench followed it).
	UpdatesMS *float64 `json:"updates_ms,omitempty"`
}

// Sample is one look at the running setup, taken every second or so.
type Sample struct {
	AtS float64 `json:"at_s"`
	// Procs are the pipeline's processes, by name (none for the baseline).
	Procs map[string]Proc `json:"procs,omitempty"`
	// Jobs are the JetStream work consumers, by consumer name (none for the baseline).
	Jobs map[string]Jobs `json:"jobs,omitempty"`
	// ProxyConns are the connections open through each process's counting proxy.
	ProxyConns map[string]int `json:"proxy_conns,omitempty"`
}

// Proc is one process as /proc shows it.
type Proc struct {
	RSSBytes   int64   `json:"rss_bytes"`
	CPUSeconds float64 `json:"cpu_s"` // user + system, since the process started
	// CouchConns are its established TCP connections to CouchDB (its counting proxy), counted
	// from /proc/<pid>/fd and /proc/net/tcp.
	CouchConns int `json:"couch_conns"`
}

// Jobs is the state of one JetStream consumer.
type Jobs struct {
	Pending  uint64 `json:"pending"`   // not yet delivered
	InFlight uint64 `json:"in_flight"` // delivered, not acknowledged
}

// Kind picks the replication, the webhook or the _db_updates latencies of a run.
type Kind int

// The latencies a run measures per written doc.
const (
	Replication Kind = iota
	Webhook
	DBUpdates // the server's _db_updates row for the doc's db
)

func (k Kind) String() string {
	switch k {
	case Webhook:
		return "webhook"
	case DBUpdates:
		return "_db_updates"
	}
	return "replication"
}

func (w Write) ms(k Kind) float64 {
	switch k {
	case Webhook:
		return w.HookMS
	case DBUpdates:
		if w.UpdatesMS == nil {
			return -1
		}
		return *w.UpdatesMS
	}
	return w.ReplMS
}

// Has reports whether the run measured latencies of kind k (the baseline has no webhook; runs
// recorded before the bench followed _db_updates have no such latencies).
func (r Run) Has(k Kind) bool {
	switch k {
	case Webhook:
		return !r.Baseline
	case DBUpdates:
		return slices.ContainsFunc(r.Writes, func(w Write) bool { return w.UpdatesMS != nil })
	}
	return true
}

// AfterUpdates returns, for each written doc that arrived (kind k) and whose _db_updates row
// was seen, its latency less the row's: what came after the feed named the db. It is negative
// for a doc that arrived first (a hot feed does not wait for _db_updates).
func (r Run) AfterUpdates(k Kind) []float64 {
	var out []float64
	for _, w := range r.Writes {
		if v, u := w.ms(k), w.ms(DBUpdates); v >= 0 && u >= 0 {
			out = append(out, v-u)
		}
	}
	return out
}

// Latencies returns the latencies (ms) of the docs that arrived, in write order.
func (r Run) Latencies(k Kind) []float64 {
	out := make([]float64, 0, len(r.Writes))
	for _, w := range r.Writes {
		if v := w.ms(k); v >= 0 {
			out = append(out, v)
		}
	}
	return out
}

// UpdatesTable renders, for the runs that followed _db_updates, where their latency went: the
// time until the server's _db_updates feed named the written db (every job the producer starts
// from that feed waits for it), and the replication and webhook latencies less that wait, per
// written doc, as p50 / p95 / p99 in ms. "" when no run followed the feed.
func UpdatesTable(runs []Run) string {
	var sb strings.Builder
	cells := func(ms []float64) string {
		if len(ms) == 0 {
			return "—"
		}
		return fmt.Sprintf("%.0f / %.0f / %.0f", Percentile(ms, 0.5), Percentile(ms, 0.95), Percentile(ms, 0.99))
	}
	for _, r := range runs {
		if !r.Has(DBUpdates) {
			continue
		}
		if sb.Len() == 0 {
			sb.WriteString("| N | setup | write→`_db_updates` row, ms (p50 / p95 / p99) | seen | write→target less the row | write→webhook less the row |\n|---|---|---|---|---|---|\n")
		}
		hook := "—"
		if r.Has(Webhook) {
			hook = cells(r.AfterUpdates(Webhook))
		}
		fmt.Fprintf(&sb, "| %d | %s | %s | %.1f %% | %s | %s |\n", r.DBs, r.SetupName, cells(r.Latencies(DBUpdates)),
			100*r.Delivered(DBUpdates), cells(r.AfterUpdates(Replication)), hook)
	}
	return sb.String()
}

// Delivered returns the fraction of written docs that arrived (0 without writes).
func (r Run) Delivered(k Kind) float64 {
	if len(r.Writes) == 0 {
		return 0
	}
	return float64(len(r.Latencies(k))) / float64(len(r.Writes))
}

// Total sums the requests of every process and endpoint.
func Total(byProc map[string]map[string]int) int {
	n := 0
	for _, eps := range byProc {
		for _, c := range eps {
			n += c
		}
	}
	return n
}

// PerDoc returns n per written doc (0 without writes).
func (r Run) PerDoc(n int) float64 {
	if len(r.Writes) == 0 {
		return 0
	}
	return float64(n) / float64(len(r.Writes))
}

// IdleRate returns the requests per second of the idle phase.
func (r Run) IdleRate() float64 {
	d := r.IdleEndS - r.IdleStartS
	if d <= 0 {
		return 0
	}
	return float64(Total(r.IdleRequests)) / d
}

// WritingConns returns the median and the most of the connections open through the proxies
// (summed over the processes) in the samples taken while the writer wrote; ok is false without
// such samples.
func (r Run) WritingConns() (median, most int, ok bool) {
	var open []int
	for _, s := range r.Samples {
		if s.AtS >= r.WriterStartS && s.AtS <= r.WriterEndS && s.ProxyConns != nil {
			open = append(open, SumConns(s.ProxyConns))
		}
	}
	if len(open) == 0 {
		return 0, 0, false
	}
	return Percentile(open, 0.5), slices.Max(open), true
}

// SumConns sums connections over the processes.
func SumConns(byProc map[string]int) int {
	n := 0
	for _, c := range byProc {
		n += c
	}
	return n
}

// Percentile returns the q-quantile (0 < q ≤ 1) of xs by the nearest-rank method: the smallest
// value with at least q of the values at or below it; the zero value for no values. xs is left
// as it is.
func Percentile[T cmp.Ordered](xs []T, q float64) T {
	var zero T
	if len(xs) == 0 {
		return zero
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

// CDF returns the empirical distribution of xs as points: the values sorted, each with the
// fraction of values at or below it (the last is 1). Equal values give one point each.
func CDF(xs []float64) (values, fractions []float64) {
	values = slices.Clone(xs)
	slices.Sort(values)
	fractions = make([]float64, len(values))
	for i := range values {
		fractions[i] = float64(i+1) / float64(len(values))
	}
	return values, fractions
}

// FileName is the name under which a run is written: one file per setup and number of dbs.
func FileName(setup string, dbs int) string { return fmt.Sprintf("workload-%s-%d.json", setup, dbs) }

// WriteFile writes r as JSON to path.
func WriteFile(path string, r Run) error {
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("encode run %s/%d: %w", r.Setup, r.DBs, err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("write run: %w", err)
	}
	return nil
}

// ReadFile reads a run written by WriteFile.
func ReadFile(path string) (Run, error) {
	var r Run
	b, err := os.ReadFile(path)
	if err != nil {
		return r, fmt.Errorf("read run: %w", err)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("decode run %s: %w", path, err)
	}
	return r, nil
}
