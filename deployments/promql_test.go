package deployments

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/sirupsen/logrus"
	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The queries of the dashboard and of the alert rules are checked against what the product
// exports: the product's own collectors are registered as the binaries register them, and their
// descriptors (Describe) say every metric name and label. A query that names a metric or a label
// the product does not export fails, as does one that names a label carrying a db name.

// targetLabels are the labels Prometheus adds to every scraped series. Queries may use only
// these: any other target label depends on the scrape configuration.
var targetLabels = []string{"job", "instance"}

// standardSeries are series Prometheus itself makes, allowed besides the product's.
var standardSeries = map[string][]string{"up": nil}

// catalogue is what the product exports.
type catalogue struct {
	// labels of every series name a query may select: a histogram's _bucket (with le), _sum
	// and _count, never its bare name.
	labels map[string][]string
	// family of every series name: spiegel_job_duration_seconds_bucket → spiegel_job_duration_seconds.
	family map[string]string
}

// productCatalogue registers the collectors of the three binaries, as pkg/producer/run.go and
// pkg/consumer/app.go do, and reads their descriptors.
func productCatalogue(t *testing.T) catalogue {
	t.Helper()
	kinds := map[string]dto.MetricType{}
	// What every process has: Go and process collectors, spiegel_build_info, spiegel_ready.
	reg := metrics.NewRegistry("producer")
	health.New("", reg, map[string]health.Check{"couchdb": func(context.Context) error { return nil }}, logrus.New())
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		kinds[mf.GetName()] = mf.GetType()
	}
	// The producer's and the consumers' own metrics (one registry each: both have
	// spiegel_feed_errors_total and spiegel_rules_*). Their vectors have no series before their
	// first use, so the kinds are read from the collectors as they are registered.
	metrics.NewProducer(kindRecorder{reg, kinds})
	// Describe only: Collect would ask JetStream for consumer info.
	metrics.RegisterJobGauges(kindRecorder{reg, kinds}, nil, "SPIEGEL_WORK")
	consumer := prometheus.NewRegistry()
	metrics.NewConsumer(kindRecorder{consumer, kinds})

	c := catalogue{labels: map[string][]string{}, family: map[string]string{}}
	add := func(series, family string, lbls []string) {
		c.labels[series] = lbls
		c.family[series] = family
	}
	for _, r := range []prometheus.Collector{reg, consumer} {
		for _, d := range describe(r) {
			name, lbls := parseDesc(t, d)
			for _, l := range lbls {
				require.NotContains(t, strings.ToLower(l), "db", "%s: no label may carry a db name", name)
			}
			switch kinds[name] {
			case dto.MetricType_HISTOGRAM:
				add(name+"_bucket", name, append(slices.Clone(lbls), "le"))
				add(name+"_sum", name, lbls)
				add(name+"_count", name, lbls)
			case dto.MetricType_SUMMARY:
				add(name, name, append(slices.Clone(lbls), "quantile"))
				add(name+"_sum", name, lbls)
				add(name+"_count", name, lbls)
			default:
				add(name, name, lbls)
			}
		}
	}
	for name, lbls := range standardSeries {
		add(name, name, lbls)
	}
	// The catalogue must see the product: a few names from each place they are registered.
	for _, name := range []string{"spiegel_jobs_published_total", "spiegel_jobs_pending", "spiegel_job_duration_seconds_bucket",
		"spiegel_ready", "spiegel_build_info", "process_cpu_seconds_total", "process_resident_memory_bytes"} {
		require.Contains(t, c.labels, name)
	}
	return c
}

// families returns the metric families whose name starts with prefix.
func (c catalogue) families(prefix string) []string {
	set := map[string]bool{}
	for _, f := range c.family {
		if strings.HasPrefix(f, prefix) {
			set[f] = true
		}
	}
	out := make([]string, 0, len(set))
	for f := range set {
		out = append(out, f)
	}
	sort.Strings(out)
	return out
}

// kindRecorder registers collectors on a registry and notes the kind of the metrics they
// describe: histogram and summary names have suffixed series.
type kindRecorder struct {
	prometheus.Registerer
	kinds map[string]dto.MetricType
}

func (k kindRecorder) Register(c prometheus.Collector) error {
	kind := dto.MetricType_UNTYPED
	switch v := c.(type) {
	case *prometheus.HistogramVec:
		kind = dto.MetricType_HISTOGRAM
	case *prometheus.SummaryVec:
		kind = dto.MetricType_SUMMARY
	case prometheus.Metric:
		var m dto.Metric
		if err := v.Write(&m); err != nil {
			return err
		}
		switch {
		case m.Histogram != nil:
			kind = dto.MetricType_HISTOGRAM
		case m.Summary != nil:
			kind = dto.MetricType_SUMMARY
		}
	}
	for _, d := range describe(c) {
		name, _, ok := descName(d)
		if !ok {
			return fmt.Errorf("unreadable descriptor %s", d)
		}
		if _, known := k.kinds[name]; !known || kind != dto.MetricType_UNTYPED {
			k.kinds[name] = kind
		}
	}
	return k.Registerer.Register(c)
}

// MustRegister keeps prometheus.Registerer's contract: it panics when a collector is refused.
func (k kindRecorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := k.Register(c); err != nil {
			panic(err)
		}
	}
}

func describe(c prometheus.Collector) []*prometheus.Desc {
	ch := make(chan *prometheus.Desc)
	go func() {
		c.Describe(ch)
		close(ch)
	}()
	var out []*prometheus.Desc
	for d := range ch {
		out = append(out, d)
	}
	return out
}

// A Desc exposes its name and labels only through String():
// Desc{fqName: "x", help: "…", unit: "", constLabels: {k="v"}, variableLabels: {a,c(b)}}.
var (
	descRE       = regexp.MustCompile(`^Desc\{fqName: ("(?:[^"\\]|\\.)*"), help: "(?:[^"\\]|\\.)*", unit: "(?:[^"\\]|\\.)*", constLabels: \{(.*)\}, variableLabels: \{(.*)\}\}$`)
	constLabelRE = regexp.MustCompile(`([A-Za-z_][A-Za-z0-9_]*)="(?:[^"\\]|\\.)*"`)
)

func descName(d *prometheus.Desc) (name string, labels []string, ok bool) {
	m := descRE.FindStringSubmatch(d.String())
	if m == nil || d.Err() != nil {
		return "", nil, false
	}
	name, err := strconv.Unquote(m[1])
	if err != nil {
		return "", nil, false
	}
	for _, cl := range constLabelRE.FindAllStringSubmatch(m[2], -1) {
		labels = append(labels, cl[1])
	}
	for _, vl := range strings.Split(m[3], ",") {
		if vl = strings.TrimSuffix(strings.TrimPrefix(vl, "c("), ")"); vl != "" {
			labels = append(labels, vl)
		}
	}
	return name, labels, true
}

func parseDesc(t *testing.T, d *prometheus.Desc) (string, []string) {
	t.Helper()
	name, lbls, ok := descName(d)
	require.True(t, ok, "cannot read the name of %s: has prometheus.Desc.String changed?", d)
	return name, lbls
}

// promqlParser parses PromQL as Prometheus does by default.
var promqlParser = parser.NewParser(parser.Options{})

// checkQuery parses expr and returns what is wrong with it against c: a syntax error, a metric
// the product does not export, a label a selector, a grouping or a vector matching names that
// its metrics do not have (target labels job and instance aside), a label carrying a db name.
// It also returns the series names the query selects.
func (c catalogue) checkQuery(expr string) (problems, names []string) {
	e, err := promqlParser.ParseExpr(expr)
	if err != nil {
		return []string{fmt.Sprintf("does not parse: %v", err)}, nil
	}
	// labelsUnder is every label the series selected under n may have.
	labelsUnder := func(n parser.Node) map[string]bool {
		set := map[string]bool{}
		for _, l := range targetLabels {
			set[l] = true
		}
		parser.Inspect(n, func(node parser.Node, _ []parser.Node) error {
			if vs, ok := node.(*parser.VectorSelector); ok {
				for _, l := range c.labels[selectorName(vs)] {
					set[l] = true
				}
			}
			return nil
		})
		return set
	}
	checkLabels := func(where string, avail map[string]bool, lbls []string) {
		for _, l := range lbls {
			if strings.Contains(strings.ToLower(l), "db") {
				problems = append(problems, fmt.Sprintf("%s: label %q would carry a db name", where, l))
			}
			if !avail[l] {
				problems = append(problems, fmt.Sprintf("%s: label %q is not a label of the metrics it applies to", where, l))
			}
		}
	}
	parser.Inspect(e, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			name := selectorName(n)
			lbls, ok := c.labels[name]
			if !ok {
				problems = append(problems, fmt.Sprintf("metric %q is not exported by Spiegel (nor a standard series)", name))
				return nil
			}
			names = append(names, name)
			avail := map[string]bool{labels.MetricName: true}
			for _, l := range append(slices.Clone(lbls), targetLabels...) {
				avail[l] = true
			}
			var matched []string
			for _, m := range n.LabelMatchers {
				matched = append(matched, m.Name)
			}
			checkLabels(n.String(), avail, matched)
		case *parser.AggregateExpr:
			checkLabels(n.String(), labelsUnder(n.Expr), n.Grouping)
		case *parser.BinaryExpr:
			if vm := n.VectorMatching; vm != nil {
				avail := labelsUnder(n.LHS)
				for l := range labelsUnder(n.RHS) {
					avail[l] = true
				}
				checkLabels(n.String(), avail, append(slices.Clone(vm.MatchingLabels), vm.Include...))
			}
		}
		return nil
	})
	return problems, names
}

// selectorName is the metric a selector names ("" if none).
func selectorName(vs *parser.VectorSelector) string {
	if vs.Name != "" {
		return vs.Name
	}
	for _, m := range vs.LabelMatchers {
		if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
			return m.Value
		}
	}
	return ""
}

// The checker itself: it must refuse what it exists to refuse.
func TestQueryChecker(t *testing.T) {
	t.Parallel()
	c := productCatalogue(t)
	for _, tc := range []struct {
		expr string
		ok   bool
	}{
		{`sum by (group) (rate(spiegel_jobs_published_total{job="p"}[5m]))`, true},
		{`histogram_quantile(0.9, sum by (group, le) (rate(spiegel_job_duration_seconds_bucket[5m])))`, true},
		{`up == 0 and on (job, instance) spiegel_build_info`, true},
		{`absent(spiegel_build_info{component="producer"})`, true},
		{`rate(spiegel_no_such_metric_total[5m])`, false},                             // unknown metric
		{`rate(spiegel_job_duration_seconds[5m])`, false},                             // a histogram's bare name
		{`spiegel_jobs_published`, false},                                             // a counter without _total
		{`sum by (db) (rate(spiegel_jobs_total[5m]))`, false},                         // a db label
		{`spiegel_jobs_pending{db="users"}`, false},                                   // a db label
		{`sum by (rule) (rate(spiegel_jobs_total[5m]))`, false},                       // a label it does not have
		{`spiegel_ready * on (pod) spiegel_build_info`, false},                        // a target label we do not rely on
		{`sum(rate(spiegel_jobs_total[5m])`, false},                                   // syntax
		{`rate(spiegel_jobs_total[$__rate_interval])`, false},                         // Grafana variables are substituted first
		{`sum by (le) (rate(spiegel_replication_duration_seconds_bucket[5m]))`, true}, // le of a histogram
	} {
		problems, _ := c.checkQuery(tc.expr)
		if tc.ok {
			assert.Empty(t, problems, tc.expr)
		} else {
			assert.NotEmpty(t, problems, "%s must be refused", tc.expr)
		}
	}
	assert.Contains(t, c.families("spiegel_"), "spiegel_ready")
	assert.Contains(t, c.families("spiegel_"), "spiegel_job_duration_seconds")
}
