package main

import (
	"context"
	"fmt"
	"io"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// metricRow is one line of the metrics reference.
type metricRow struct {
	name, kind, help string
	labels           []string
	processes        string
}

// metricsReference registers the collectors of the three binaries on fresh registries, as
// pkg/producer/run.go and pkg/consumer/app.go do, and renders every spiegel_ metric they
// describe as a Markdown table: name, type, labels, the processes that export it, help.
func metricsReference() (string, error) {
	log := logrus.New()
	log.Out = io.Discard
	all := newRecorder(metrics.NewRegistry("confdoc"))
	health.New("", all.reg, map[string]health.Check{"couchdb": func(context.Context) error { return nil }}, log)
	producer := newRecorder(prometheus.NewRegistry())
	metrics.NewProducer(producer)
	metrics.RegisterJobGauges(producer, idleJetStream{}, "SPIEGEL_WORK")
	consumer := newRecorder(prometheus.NewRegistry())
	metrics.NewConsumer(consumer)
	metrics.RegisterJobGauges(consumer, idleJetStream{}, "SPIEGEL_WORK")

	byKey := map[string]*metricRow{}
	var rows []*metricRow
	for _, part := range []struct {
		rec   *recorder
		procs string
	}{{all, "all"}, {producer, "producer"}, {consumer, "replicator, onchange"}} {
		found, err := part.rec.rows()
		if err != nil {
			return "", err
		}
		for _, r := range found {
			key := r.name + "\x00" + r.kind + "\x00" + r.help + "\x00" + strings.Join(r.labels, ",")
			if prev, ok := byKey[key]; ok {
				prev.processes = "all" // the producer's and the consumers' alike
				continue
			}
			r.processes = part.procs
			byKey[key] = r
			rows = append(rows, r)
		}
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].name < rows[j].name })

	var b strings.Builder
	b.WriteString("| metric | type | labels | exported by | meaning |\n| --- | --- | --- | --- | --- |\n")
	for _, r := range rows {
		labels := "—"
		if len(r.labels) > 0 {
			labels = "`" + strings.Join(r.labels, "`, `") + "`"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s |\n", r.name, r.kind, labels, r.processes, strings.ReplaceAll(r.help, "|", `\|`))
	}
	return b.String(), nil
}

// recorder registers collectors on a registry and notes the type of the metrics they describe:
// a vector has no series before its first use, so its type is read from the collector itself.
type recorder struct {
	reg        *prometheus.Registry
	collectors []prometheus.Collector
	kinds      map[string]string
}

func newRecorder(reg *prometheus.Registry) *recorder {
	return &recorder{reg: reg, kinds: map[string]string{}}
}

func (r *recorder) Register(c prometheus.Collector) error {
	if err := r.reg.Register(c); err != nil {
		return err
	}
	r.collectors = append(r.collectors, c)
	kind := ""
	switch v := c.(type) {
	case *prometheus.CounterVec:
		kind = "counter"
	case *prometheus.GaugeVec:
		kind = "gauge"
	case *prometheus.HistogramVec:
		kind = "histogram"
	case *prometheus.SummaryVec:
		kind = "summary"
	case prometheus.Metric:
		var m dto.Metric
		if err := v.Write(&m); err != nil {
			return err
		}
		kind = kindOf(&m)
	}
	if kind != "" {
		for _, d := range describe(c) {
			if name, _, _, ok := parseDesc(d); ok {
				r.kinds[name] = kind
			}
		}
	}
	return nil
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err) // as prometheus.Registry.MustRegister; only reached by a duplicate metric
		}
	}
}

func (r *recorder) Unregister(c prometheus.Collector) bool { return r.reg.Unregister(c) }

// rows returns the spiegel_ metrics of the registry: its own descriptors (the registry as a
// collector describes everything registered on it, also what was registered directly), their
// types from the collectors or, for custom collectors, from a gather.
func (r *recorder) rows() ([]*metricRow, error) {
	mfs, err := r.reg.Gather()
	if err != nil {
		return nil, fmt.Errorf("gather: %w", err)
	}
	for _, mf := range mfs {
		if _, ok := r.kinds[mf.GetName()]; !ok {
			r.kinds[mf.GetName()] = strings.ToLower(mf.GetType().String())
		}
	}
	var out []*metricRow
	for _, d := range describe(r.reg) {
		name, help, labels, ok := parseDesc(d)
		if !ok {
			return nil, fmt.Errorf("cannot read %s: has prometheus.Desc.String changed?", d)
		}
		if !strings.HasPrefix(name, "spiegel_") {
			continue // the Go and process collectors: go_*, process_*
		}
		kind := r.kinds[name]
		if kind == "" {
			return nil, fmt.Errorf("%s: type unknown", name)
		}
		out = append(out, &metricRow{name: name, kind: kind, help: help, labels: labels})
	}
	return out, nil
}

func kindOf(m *dto.Metric) string {
	switch {
	case m.Counter != nil:
		return "counter"
	case m.Gauge != nil:
		return "gauge"
	case m.Histogram != nil:
		return "histogram"
	case m.Summary != nil:
		return "summary"
	}
	return "untyped"
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

var descRE = regexp.MustCompile(`^Desc\{fqName: ("(?:[^"\\]|\\.)*"), help: ("(?:[^"\\]|\\.)*"), .*variableLabels: \{([^}]*)\}\}$`)

// parseDesc reads name, help and variable labels from prometheus.Desc's String form, the only
// way the client library shows them.
func parseDesc(d *prometheus.Desc) (name, help string, labels []string, ok bool) {
	m := descRE.FindStringSubmatch(d.String())
	if m == nil {
		return "", "", nil, false
	}
	name, err1 := strconv.Unquote(m[1])
	help, err2 := strconv.Unquote(m[2])
	if err1 != nil || err2 != nil {
		return "", "", nil, false
	}
	for _, l := range strings.Split(m[3], ",") {
		if l = strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")"); l != "" {
			labels = append(labels, l)
		}
	}
	return name, help, slices.Clip(labels), true
}

// idleJetStream answers the job gauges' consumer-info reads with an empty consumer, so that a
// gather shows their type without a NATS server.
type idleJetStream struct{ jetstream.JetStream }

func (idleJetStream) Consumer(context.Context, string, string) (jetstream.Consumer, error) {
	return idleConsumer{}, nil
}

type idleConsumer struct{ jetstream.Consumer }

func (idleConsumer) Info(context.Context) (*jetstream.ConsumerInfo, error) {
	return &jetstream.ConsumerInfo{}, nil
}
