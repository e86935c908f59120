package e2e

import (
	"fmt"
	"math"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// streamsVariant is what one variant of a (workload, topology) measured.
type streamsVariant struct {
	name   string
	dur    time.Duration      // until every change was acknowledged, or was in the stream or bucket
	count  int                // changes acknowledged, or in the stream or bucket, when it was timed
	cpu    map[string]float64 // CPU seconds by process: bench (this one), producer, onchange, couchdb
	issues []string           // log lines at warn and above, processes that did not stop cleanly, cleanup failures
}

// streamsRow is one (workload, topology): the loop twice, the subject rule and the mirror rule.
type streamsRow struct {
	workload                      streamsWorkload
	topology                      string
	loop1, subject, mirror, loop2 *streamsVariant
	loadFrom, loadTo              string
	failed                        string // the variant that did not finish, and how far it got
}

// rate is changes per second.
func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// loopRate is the loop's docs/s over the mean time of its runs (0 before the first).
func (r *streamsRow) loopRate() float64 {
	var sum time.Duration
	n := 0
	for _, v := range []*streamsVariant{r.loop1, r.loop2} {
		if v != nil {
			sum += v.dur
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return rate(r.workload.changes(), sum/time.Duration(n))
}

// variantRate is v's docs/s (0 when it did not finish).
func (r *streamsRow) variantRate(v *streamsVariant) float64 {
	if v == nil {
		return 0
	}
	return rate(r.workload.changes(), v.dur)
}

// ratio is v's docs/s over the loop's (0 when either is missing).
func (r *streamsRow) ratio(v *streamsVariant) float64 {
	l := r.loopRate()
	if l == 0 || v == nil {
		return 0
	}
	return r.variantRate(v) / l
}

func (r *streamsRow) summary() string {
	return fmt.Sprintf("loop %s docs/s (runs %s, %s), subject rule %s docs/s (%.2f× the loop), mirror rule %s docs/s (%.2f× the loop)",
		num(r.loopRate()), num(r.variantRate(r.loop1)), num(r.variantRate(r.loop2)),
		num(r.variantRate(r.subject)), r.ratio(r.subject), num(r.variantRate(r.mirror)), r.ratio(r.mirror))
}

func (r *streamsRow) reportMetrics(b *testing.B) {
	if r.loop1 == nil || r.loop2 == nil || r.subject == nil || r.mirror == nil {
		return
	}
	b.ReportMetric(r.loopRate(), "loop-docs/s")
	b.ReportMetric(r.variantRate(r.subject), "subject-docs/s")
	b.ReportMetric(r.variantRate(r.mirror), "mirror-docs/s")
	b.ReportMetric(r.ratio(r.subject), "subject/loop")
	b.ReportMetric(r.ratio(r.mirror), "mirror/loop")
}

// streamsReport is the run's report, written again after every (workload, topology) so that a
// run stopped later keeps what it measured.
type streamsReport struct {
	path               string
	started            time.Time
	loadFrom, loadTo   string
	server, nats, sync string
	commit             string
	cores              int
	limit              time.Duration
	vars               []string
	loads              []string // what each workload's loading did
	rows               []*streamsRow
}

func (rep *streamsReport) write(b *testing.B) {
	if err := os.WriteFile(rep.path, []byte(rep.markdown()), 0o644); err != nil {
		b.Logf("write %s: %v", rep.path, err)
	}
}

// table is the summary table: docs/s per variant and the ratios to the loop.
func (rep *streamsReport) table() string {
	var sb strings.Builder
	sb.WriteString("| workload (dbs × docs) | NATS | loop docs/s (run 1, run 2) | subject rule docs/s | mirror rule docs/s | subject ÷ loop | mirror ÷ loop | load average |\n")
	sb.WriteString("|---|---|---|---|---|---|---|---|\n")
	for _, r := range rep.rows {
		cell := func(v *streamsVariant) string {
			if v == nil {
				return "—"
			}
			return num(r.variantRate(v))
		}
		ratio := func(v *streamsVariant) string {
			if x := r.ratio(v); x > 0 {
				return fmt.Sprintf("%.2f", x)
			}
			return "—"
		}
		loop := "—"
		if r.loop1 != nil {
			loop = fmt.Sprintf("%s (%s, %s)", num(r.loopRate()), cell(r.loop1), cell(r.loop2))
		}
		load := r.loadFrom
		if r.loadTo != "" {
			load += " → " + r.loadTo
		}
		fmt.Fprintf(&sb, "| %d × %s | %s | %s | %s | %s | %s | %s | %s |\n", r.workload.dbs, num(float64(r.workload.docs)), r.topology,
			loop, cell(r.subject), cell(r.mirror), ratio(r.subject), ratio(r.mirror), load)
	}
	return sb.String()
}

func (rep *streamsReport) markdown() string {
	var sb strings.Builder
	sb.WriteString("# Change streams against a hand-written loop (`make bench-streams`)\n\n")
	commit := ""
	if rep.commit != "" {
		commit = ", commit " + rep.commit
	}
	fmt.Fprintf(&sb, "Run of %s%s. CouchDB: %s. NATS: nats-server %s in the benchmark's process, JetStream file storage, %s; "+
		"r1 one server, r3 a three-node cluster (streams and buckets R3, SPIEGEL_STREAM_REPLICAS=3). "+
		"Machine: %d cores, %s; load average %s at the start", rep.started.UTC().Format("2006-01-02 15:04 MST"), commit, rep.server,
		rep.nats, rep.sync, rep.cores, runtime.Version(), rep.loadFrom)
	if rep.loadTo != "" {
		fmt.Fprintf(&sb, ", %s at the end", rep.loadTo)
	}
	fmt.Fprintf(&sb, ". A variant may take %s (BENCH_STREAMS_LIMIT).\n\n", rep.limit)
	pipeline := "the product's defaults"
	if len(rep.vars) > 0 {
		pipeline = "the product's defaults and " + strings.Join(rep.vars, " ")
	}
	fmt.Fprintf(&sb, "Pipeline: bin/producer and one bin/onchange with %s (the producer from now, no sweep: the rule's catch-up enqueues the dbs).\n\n", pipeline)
	if len(rep.loads) > 0 {
		fmt.Fprintf(&sb, "Workload dbs: %s.\n\n", strings.Join(rep.loads, "; "))
	}
	sb.WriteString(rep.table())
	sb.WriteString("\n- **loop**: for each db in turn, `_changes?include_docs=true` in pages of 1,000, every change published with " +
		"`PublishMsgAsync` as JSON (message id `<db>/<doc id>/<rev>`) to a fresh stream, the page's acks awaited before the next page; " +
		"from its start until every change is acknowledged. Run before and after the rules; its docs/s is over the mean of the two times.\n" +
		"- **subject rule**: `{\"type\": \"on_change\", \"db_name\": <the workload's dbs>, \"subject\": \"bench.changes.${db_name}\"}` " +
		"into a fresh stream capturing `bench.changes.>`; from the rule doc's creation until the stream holds every change.\n" +
		"- **mirror rule**: `{\"type\": \"on_change\", \"db_name\": …, \"mirror\": \"BENCH_MIRROR\"}` into a fresh bucket (history 1, the " +
		"topology's replicas); from the rule doc's creation until the bucket holds every doc's key (its keys less one fence key per db).\n" +
		"- Streams: file storage, the topology's replicas, 24 h duplicate window, atomic publishes allowed (as install's SPIEGEL_CHANGES). " +
		"Each rule runs on a fresh spiegel db, subject prefix and rule id (no checkpoint carries over), removed afterwards with `producer uninstall`.\n")
	sb.WriteString("\n## Times and CPU\n\n")
	sb.WriteString("CPU seconds while the variant was timed: this process (the NATS servers, and the loop or the poller), the pipeline's processes, and CouchDB when BENCH_SERVER_PID names it " +
		"(what every client of the server cost it meanwhile, other work on a shared server included).\n\n")
	sb.WriteString("| workload | NATS | variant | time | docs/s | CPU: this process | onchange | producer | CouchDB |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rep.rows {
		for _, v := range []*streamsVariant{r.loop1, r.subject, r.mirror, r.loop2} {
			if v == nil {
				continue
			}
			fmt.Fprintf(&sb, "| %s | %s | %s | %.2f s | %s | %s | %s | %s | %s |\n", r.workload, r.topology, v.name, v.dur.Seconds(),
				num(r.variantRate(v)), cpuCell(v, "bench"), cpuCell(v, "onchange"), cpuCell(v, "producer"), cpuCell(v, "couchdb"))
		}
	}
	var failed, issues []string
	for _, r := range rep.rows {
		if r.failed != "" {
			failed = append(failed, fmt.Sprintf("- %s %s: %s", r.workload, r.topology, r.failed))
		}
		for _, v := range []*streamsVariant{r.subject, r.mirror} {
			if v == nil {
				continue
			}
			if len(v.issues) == 0 {
				issues = append(issues, fmt.Sprintf("- %s %s, %s: none", r.workload, r.topology, v.name))
			}
			for _, s := range v.issues {
				issues = append(issues, fmt.Sprintf("- %s %s, %s: %s", r.workload, r.topology, v.name, s))
			}
		}
	}
	if len(failed) > 0 {
		sb.WriteString("\n## Did not finish\n\n" + strings.Join(failed, "\n") + "\n")
	}
	if len(issues) > 0 {
		sb.WriteString("\n## The pipeline's logs (warn and above), stops and cleanup\n\n" + strings.Join(issues, "\n") + "\n")
	}
	return sb.String()
}

func cpuCell(v *streamsVariant, name string) string {
	if s, ok := v.cpu[name]; ok {
		return fmt.Sprintf("%.1f s", s)
	}
	return "—"
}

// num formats x rounded, with thousands separated by commas (3 significant digits below 100).
func num(x float64) string {
	if x < 100 {
		return strconv.FormatFloat(x, 'f', 2-int(math.Floor(math.Log10(max(x, 1)))), 64)
	}
	s := strconv.FormatInt(int64(x+0.5), 10)
	var out []byte
	for i, c := range []byte(s) {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, c)
	}
	return string(out)
}

// The variables parse as documented, and refuse what they cannot mean.
func TestStreamsConfig(t *testing.T) {
	t.Setenv("BENCH_STREAMS_WORKLOADS", "")
	t.Setenv("BENCH_STREAMS_TOPOLOGIES", "")
	t.Setenv("BENCH_STREAMS_LIMIT", "")
	t.Setenv("BENCH_STREAMS_VARS", "")
	c, err := streamsConfigFromEnv()
	require.NoError(t, err)
	assert.Equal(t, []streamsWorkload{{1, 100000}, {1, 20000}, {100, 500}}, c.workloads)
	assert.Equal(t, []string{"r1", "r3"}, c.topologies)
	assert.Equal(t, 10*time.Minute, c.limit)

	t.Setenv("BENCH_STREAMS_WORKLOADS", "10x500, 1x20000")
	t.Setenv("BENCH_STREAMS_TOPOLOGIES", "r3")
	t.Setenv("BENCH_STREAMS_LIMIT", "90s")
	t.Setenv("BENCH_STREAMS_VARS", "SPIEGEL_CHANGES_BATCH=1000  SPIEGEL_CONCURRENCY=4")
	c, err = streamsConfigFromEnv()
	require.NoError(t, err)
	assert.Equal(t, []streamsWorkload{{10, 500}, {1, 20000}}, c.workloads)
	assert.Equal(t, []string{"r3"}, c.topologies)
	assert.Equal(t, 90*time.Second, c.limit)
	assert.Equal(t, []string{"SPIEGEL_CHANGES_BATCH=1000", "SPIEGEL_CONCURRENCY=4"}, c.vars)

	for name, bad := range map[string]string{
		"BENCH_STREAMS_WORKLOADS":  "100",
		"BENCH_STREAMS_TOPOLOGIES": "r2",
		"BENCH_STREAMS_LIMIT":      "ten minutes",
		"BENCH_STREAMS_VARS":       "CHANGES_BATCH=1",
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv(name, bad)
			_, err := streamsConfigFromEnv()
			assert.ErrorContains(t, err, name)
		})
	}
	_, err = parseStreamsWorkloads("1x20000,1x20000")
	assert.ErrorContains(t, err, "named twice")
}

// The rules' pattern matches the workload's dbs and no other workload's.
func TestStreamsPattern(t *testing.T) {
	w := streamsWorkload{10, 2000}
	re := regexp.MustCompile(w.pattern())
	assert.True(t, re.MatchString(w.dbName(0)))
	assert.True(t, re.MatchString(w.dbName(9)))
	for _, other := range []string{"bench-streams-10x20000-0", "bench-streams-100x2000-0", "bench-streams-10x2000-", "bench-streams-10x2000-1-x",
		"bench-streams-spiegel-r1-subject-1", "xbench-streams-10x2000-0"} {
		assert.False(t, re.MatchString(other), other)
	}
}

// The report gives docs/s and the ratios to the loop's mean, and where a variant stopped.
func TestStreamsReport(t *testing.T) {
	row := &streamsRow{workload: streamsWorkload{1, 20000}, topology: "r1", loadFrom: "1.00 0.50 0.20", loadTo: "2.00 1.00 0.50",
		loop1:   &streamsVariant{name: "loop, run 1", dur: 2 * time.Second, cpu: map[string]float64{"bench": 1.5}},
		loop2:   &streamsVariant{name: "loop, run 2", dur: 2 * time.Second},
		subject: &streamsVariant{name: "subject rule", dur: 8 * time.Second, issues: []string{"onchange: 1× warn: slow"}},
		mirror:  &streamsVariant{name: "mirror rule", dur: 16 * time.Second}}
	assert.InDelta(t, 10000, row.loopRate(), 0.01)
	assert.InDelta(t, 0.25, row.ratio(row.subject), 1e-9)
	assert.InDelta(t, 0.125, row.ratio(row.mirror), 1e-9)
	failed := &streamsRow{workload: streamsWorkload{10, 500}, topology: "r3", loadFrom: "3.00 2.00 1.00",
		loop1:  &streamsVariant{name: "loop, run 1", dur: time.Second},
		failed: "mirror rule: 1200 of 5000 doc keys in bucket BENCH_MIRROR after 10m0s"}
	rep := &streamsReport{server: "Apache CouchDB 3.3.3", nats: "2.15.2", cores: 2, limit: 10 * time.Minute, rows: []*streamsRow{row, failed}}
	md := rep.markdown()
	assert.Contains(t, md, "| 1 × 20,000 | r1 | 10,000 (10,000, 10,000) | 2,500 | 1,250 | 0.25 | 0.12 | 1.00 0.50 0.20 → 2.00 1.00 0.50 |")
	assert.Contains(t, md, "| 10 × 500 | r3 | 5,000 (5,000, —) | — | — | — | — | 3.00 2.00 1.00 |")
	assert.Contains(t, md, "- 10x500 r3: mirror rule: 1200 of 5000 doc keys")
	assert.Contains(t, md, "- 1x20000 r1, subject rule: onchange: 1× warn: slow")
	assert.Contains(t, md, "| 1x20000 | r1 | loop, run 1 | 2.00 s | 10,000 | 1.5 s | — | — | — |")
	assert.Equal(t, "12.3", num(12.34))
	assert.Equal(t, "1.23", num(1.234))
	assert.Equal(t, "1,234,568", num(1234567.8))
}
