package e2e

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// serverName names the server under test for reports.
func serverName(cs *couchtest.Server) string {
	if cs.PouchDB {
		return "PouchDB Server " + cs.Version + " (its _db_updates from the test proxy, 500 ms batches)"
	}
	return "Apache CouchDB " + cs.Version
}

// workloadReport renders the results as Markdown.
func workloadReport(cs *couchtest.Server, w workload, results []workloadResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "## Workload: %d dbs × %d docs, %d active, %.0f docs/s for %s\n\n", w.dbs, w.docsPerDB, w.active, w.rate, w.duration)
	if w.q > 0 {
		fmt.Fprintf(&sb, "The user dbs were created with q = %d (BENCH_Q); the target with the server's default.\n\n", w.q)
	}
	fmt.Fprintf(&sb, "Server: %s. One pattern replicator rule (every user db into one target) and one on_change rule (a GET per change to a local webhook). "+
		"Latency: from the write's answer to the doc on the target's feed, or at the webhook. Requests: CouchDB requests by the pipeline's processes "+
		"(for the _replicator baseline: by the server's replications, when the server is on this machine) while the writer ran and until every doc arrived, per written doc.\n\n",
		serverName(cs))
	sb.WriteString("| setup | initial sync | replication p50 / p95 / p99 | webhook p50 / p95 / p99 | lost | requests/doc | spiegel-db writes/doc | max connections | idle requests/s (connections open) |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		hook := "—"
		if !r.setup.replicatorDB {
			hook = fmt.Sprintf("%.0f / %.0f / %.0f ms", ms(benchdata.Percentile(r.hook, 0.5)), ms(benchdata.Percentile(r.hook, 0.95)), ms(benchdata.Percentile(r.hook, 0.99)))
		}
		sync := fmt.Sprintf("%.1f s", r.initialSync.Seconds())
		if r.initialSync < 0 {
			sync = fmt.Sprintf("incomplete (%d of %d docs)", r.synced, w.dbs*w.docsPerDB)
		}
		reqs, writes, conns, idle := "—", "—", "—", "—"
		if len(r.requests) > 0 {
			reqs = fmt.Sprintf("%.2f", r.perDoc(r.total()))
			writes = fmt.Sprintf("%.2f", r.perDoc(r.spiegelWrites()))
			conns = strconv.Itoa(benchdata.SumConns(r.maxConns))
			idle = fmt.Sprintf("%.2f (%d)", r.idleRate(), benchdata.SumConns(r.idleConns))
		}
		fmt.Fprintf(&sb, "| %s | %s | %.0f / %.0f / %.0f ms | %s | %d / %d | %s | %s | %s | %s |\n",
			r.setup.name, sync, ms(benchdata.Percentile(r.repl, 0.5)), ms(benchdata.Percentile(r.repl, 0.95)), ms(benchdata.Percentile(r.repl, 0.99)),
			hook, r.lostRepl, r.lostHook, reqs, writes, conns, idle)
	}
	sb.WriteString("\n" + benchdata.UpdatesTable(runsOf(cs, w, results)))
	for _, r := range results {
		if r.hotFeedsOpened >= 0 && !r.setup.replicatorDB {
			fmt.Fprintf(&sb, "\nHot feeds opened by the producer, %s: %.0f, %.3f per written doc.\n", r.setup.name, r.hotFeedsOpened, r.perDoc(int(r.hotFeedsOpened)))
		}
	}
	for _, r := range results {
		if len(r.requests) == 0 {
			continue
		}
		fmt.Fprintf(&sb, "\n### Requests per written doc: %s\n\n", r.setup.name)
		sb.WriteString(benchdata.EndpointTable(r.record(cs, w)))
	}
	return sb.String()
}

// record is the result as the end-to-end report reads it.
// runsOf returns the records of results.
func runsOf(cs *couchtest.Server, w workload, results []workloadResult) []benchdata.Run {
	runs := make([]benchdata.Run, len(results))
	for i, r := range results {
		runs[i] = r.record(cs, w)
	}
	return runs
}

func (r workloadResult) record(cs *couchtest.Server, w workload) benchdata.Run {
	sync := r.initialSync.Seconds()
	if r.initialSync < 0 {
		sync = -1
	}
	run := benchdata.Run{
		Setup: r.setup.key, SetupName: r.setup.name, Baseline: r.setup.replicatorDB, Server: serverName(cs),
		DBs: w.dbs, DocsPerDB: w.docsPerDB, Active: w.active, Rate: w.rate, DurationS: w.duration.Seconds(),
		Started: r.started, LoadAvgStart: r.loadStart, LoadAvgEnd: r.loadEnd,
		InitialSyncS: sync, InitialDocs: w.dbs * w.docsPerDB, InitialSyncDocs: r.synced,
		WriterStartS: r.writerStart.Seconds(), WriterEndS: r.writerEnd.Seconds(),
		IdleStartS: r.idleStart.Seconds(), IdleEndS: r.idleEnd.Seconds(),
		Writes: r.writes, Requests: r.requests, IdleRequests: r.idle,
		MaxConns: r.maxConns, IdleConns: r.idleConns, ConnsMeasured: r.unmeasured == "",
		Samples: r.samples,
	}
	if r.unmeasured != "" {
		run.Notes = append(run.Notes, r.unmeasured)
	}
	return run
}
