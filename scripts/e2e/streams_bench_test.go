package e2e

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// BenchmarkStreams measures the change streams of on_change rules against a hand-written loop
// that does the same work, in one run, per workload and NATS topology (make bench-streams):
//
//   - loop: for each db, one after another, read _changes?include_docs=true in pages of 1,000
//     and PublishMsgAsync every change as JSON, message id <db>/<doc id>/<rev>, to
//     loop.<db token> of a fresh stream, waiting for the page's acks before the next page;
//     timed from its start until every change is acknowledged;
//   - subject: a `subject` rule publishing to bench.changes.${db_name}, captured by a fresh
//     stream; timed from the rule doc's creation until the stream holds every change;
//   - mirror: a `mirror` rule into a fresh bucket (history 1, the topology's replicas, created
//     beforehand); timed from the rule doc's creation until the bucket holds every doc's key
//     (keys less the mirror's fence keys, one per db);
//   - the loop again. The loop's figure is the mean of its two runs, so that a machine getting
//     busier during the run weighs on both sides.
//
// The rules run through the real binaries (bin/producer and one bin/onchange, on a fresh
// spiegel db and subject prefix per rule, so that no checkpoint or completion record carries
// over; removed with `producer uninstall` afterwards), against an in-process nats-server with
// JetStream file storage (r1) or a three-node JetStream cluster (r3, streams and buckets R3,
// SPIEGEL_STREAM_REPLICAS=3). Streams of the loop and of the subject rule: file storage, 24 h
// duplicate window, atomic publishes allowed (as install's SPIEGEL_CHANGES).
//
// Workload dbs are named bench-streams-<dbs>x<docs>-<i>, hold docs of about 200 bytes loaded with
// _bulk_docs, and are kept for the next run, which reuses a db that holds exactly those docs
// (BENCH_STREAMS_DROP_DBS=1 deletes them at the end). The rules match only them.
//
// Variables: BENCH_STREAMS_WORKLOADS (1x100000,1x20000,100x500: dbs x docs per db),
// BENCH_STREAMS_TOPOLOGIES (r1,r3), BENCH_STREAMS_LIMIT (10m: how long one variant may take
// before the benchmark fails, saying how far it got), BENCH_STREAMS_VARS (extra SPIEGEL_
// variables of the pipeline's processes, space-separated), BENCH_OUT (where report.md goes;
// bench-streams at the repository root), BENCH_SERVER_PID (the CouchDB server's process, for its
// CPU time), BENCH_STREAMS_COMMIT (named in the report). Nothing asserts a timing.
func BenchmarkStreams(b *testing.B) {
	root := repoRoot(b, "producer", "onchange")
	cfg, err := streamsConfigFromEnv()
	if err != nil {
		b.Fatal(err)
	}
	cs := couchtest.Get(b)
	up := cs.NewUpdatesProxy(b, couchtest.CoalesceWindow(500*time.Millisecond))
	couchURL := cs.URL
	if up.Synthetic() {
		// PouchDB Server has no _db_updates: the producer reads the test proxy's. The loop reads
		// the server directly.
		couchURL = up.URL()
	}
	rep := &streamsReport{
		path:     filepath.Join(cmp.Or(os.Getenv("BENCH_OUT"), filepath.Join(root, "bench-streams")), "report.md"),
		started:  time.Now(),
		loadFrom: loadAvg(),
		server:   serverName(cs),
		nats:     natsServerVersion(),
		sync:     natsSyncSetting(),
		commit:   os.Getenv("BENCH_STREAMS_COMMIT"),
		cores:    runtime.NumCPU(),
		limit:    cfg.limit,
		vars:     cfg.vars,
	}
	if err := os.MkdirAll(filepath.Dir(rep.path), 0o755); err != nil {
		b.Fatalf("report dir: %v", err)
	}
	b.Logf("CouchDB: %s; nats-server %s; load average %s", rep.server, rep.nats, rep.loadFrom)
	for _, w := range cfg.workloads {
		loaded := ensureStreamsDBs(b, cs, w)
		rep.loads = append(rep.loads, loaded)
		b.Logf("workload %s: %s", w, loaded)
		if os.Getenv("BENCH_STREAMS_DROP_DBS") == "1" {
			for i := range w.dbs {
				cs.Cleanup(b, w.dbName(i))
			}
		}
	}
	for _, w := range cfg.workloads {
		for _, topo := range cfg.topologies {
			row := &streamsRow{workload: w, topology: topo}
			rep.rows = append(rep.rows, row)
			b.Run(w.String()+"/"+topo, func(b *testing.B) {
				r := &streamsRun{root: root, cs: cs, couchURL: couchURL, writer: up.Server(), cfg: cfg, w: w, row: row, rep: rep}
				for range b.N {
					r.run(b)
				}
				row.reportMetrics(b)
			})
			rep.write(b)
		}
	}
	rep.loadTo = loadAvg()
	rep.write(b)
	b.Logf("report: %s\n%s", rep.path, rep.table())
}

// streamsConfig is what the BENCH_STREAMS_ variables ask for.
type streamsConfig struct {
	workloads  []streamsWorkload
	topologies []string
	limit      time.Duration
	vars       []string // extra SPIEGEL_ variables of the pipeline's processes
}

func streamsConfigFromEnv() (streamsConfig, error) {
	c := streamsConfig{limit: 10 * time.Minute}
	var err error
	if c.workloads, err = parseStreamsWorkloads(cmp.Or(os.Getenv("BENCH_STREAMS_WORKLOADS"), "1x100000,1x20000,100x500")); err != nil {
		return c, err
	}
	if c.topologies, err = parseStreamsTopologies(cmp.Or(os.Getenv("BENCH_STREAMS_TOPOLOGIES"), "r1,r3")); err != nil {
		return c, err
	}
	if v := os.Getenv("BENCH_STREAMS_LIMIT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return c, fmt.Errorf("BENCH_STREAMS_LIMIT=%q: want a duration such as 10m", v)
		}
		c.limit = d
	}
	for _, kv := range strings.Fields(os.Getenv("BENCH_STREAMS_VARS")) {
		if !strings.HasPrefix(kv, "SPIEGEL_") || !strings.Contains(kv, "=") {
			return c, fmt.Errorf("BENCH_STREAMS_VARS: %q is not a SPIEGEL_NAME=value pair", kv)
		}
		c.vars = append(c.vars, kv)
	}
	return c, nil
}

// streamsWorkload is dbs dbs of docs docs each.
type streamsWorkload struct{ dbs, docs int }

func (w streamsWorkload) String() string { return fmt.Sprintf("%dx%d", w.dbs, w.docs) }

// changes is how many changes the workload's dbs hold: one per doc.
func (w streamsWorkload) changes() int { return w.dbs * w.docs }

// dbName is the name of the workload's i-th db.
func (w streamsWorkload) dbName(i int) string { return fmt.Sprintf("%s%d", w.dbPrefix(), i) }

func (w streamsWorkload) dbPrefix() string { return fmt.Sprintf("bench-streams-%dx%d-", w.dbs, w.docs) }

// pattern is the rules' db_name: the workload's dbs and no other (no other workload's prefix
// starts with this one's, since the docs per db end at the '-').
func (w streamsWorkload) pattern() string { return "^" + w.dbPrefix() + "[0-9]+$" }

func parseStreamsWorkloads(v string) ([]streamsWorkload, error) {
	var out []streamsWorkload
	for _, f := range strings.Split(v, ",") {
		f = strings.TrimSpace(f)
		dbs, docs, ok := strings.Cut(f, "x")
		d, err1 := strconv.Atoi(dbs)
		n, err2 := strconv.Atoi(docs)
		if !ok || err1 != nil || err2 != nil || d < 1 || n < 1 || d > 10000 || n > 10_000_000 {
			return nil, fmt.Errorf("BENCH_STREAMS_WORKLOADS=%q: %q is not <dbs>x<docs per db>, such as 100x500", v, f)
		}
		w := streamsWorkload{d, n}
		for _, o := range out {
			if o == w {
				return nil, fmt.Errorf("BENCH_STREAMS_WORKLOADS=%q: %s is named twice", v, w)
			}
		}
		out = append(out, w)
	}
	return out, nil
}

func parseStreamsTopologies(v string) ([]string, error) {
	var out []string
	for _, f := range strings.Split(v, ",") {
		f = strings.TrimSpace(f)
		if f != "r1" && f != "r3" {
			return nil, fmt.Errorf("BENCH_STREAMS_TOPOLOGIES=%q: %q is not a topology (r1: one server, r3: a three-node cluster)", v, f)
		}
		for _, o := range out {
			if o == f {
				return nil, fmt.Errorf("BENCH_STREAMS_TOPOLOGIES=%q: %s is named twice", v, f)
			}
		}
		out = append(out, f)
	}
	return out, nil
}
