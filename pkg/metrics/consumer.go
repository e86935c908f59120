package metrics

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// Consumer holds the metrics of a consumer process (replicator or onchange). A nil *Consumer is
// valid and records nothing.
type Consumer struct {
	JobsRun          *prometheus.CounterVec
	JobDuration      *prometheus.HistogramVec
	WebhookRequests  *prometheus.CounterVec
	WebhookDuration  *prometheus.HistogramVec
	ChangesPublished prometheus.Counter
	OutputGaps       *prometheus.CounterVec
	Replications     *prometheus.CounterVec
	DocsWritten      prometheus.Counter
	ReplDuration     prometheus.Histogram
	DeadLetters      *prometheus.CounterVec
	FeedErrors       prometheus.Counter
	RulesLoaded      *prometheus.GaugeVec
	RulesRejected    prometheus.Gauge
}

// NewConsumer registers the consumer metrics on reg.
func NewConsumer(reg prometheus.Registerer) *Consumer {
	m := &Consumer{
		JobsRun: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_jobs_total", Help: "Jobs run, by group and result (ok, retry, delayed, failed).",
		}, []string{"group", "result"}),
		JobDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "spiegel_job_duration_seconds", Help: "Time a job's handler ran, by group.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}, []string{"group"}),
		WebhookRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_webhook_requests_total", Help: "Webhook requests, by status class (2xx, 3xx, 4xx, 5xx, error).",
		}, []string{"class"}),
		WebhookDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "spiegel_webhook_request_duration_seconds", Help: "Webhook request duration, by status class.",
			Buckets: prometheus.DefBuckets,
		}, []string{"class"}),
		ChangesPublished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_changes_published_total", Help: "Changes published to NATS by subject rules.",
		}),
		OutputGaps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_output_gaps_total", Help: "Gaps found in what on_change rules keep for readers, by kind: subject (our changes stream lacks messages a rule stored), mirror (a bucket lost a write). Reported, never mended by deleting or reordering.",
		}, []string{"kind"}),
		Replications: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_replications_total", Help: "Replications run, by engine and result (ok, error, missing_source).",
		}, []string{"engine", "result"}),
		DocsWritten: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_replication_docs_written_total", Help: "Docs written to targets by replications.",
		}),
		ReplDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "spiegel_replication_duration_seconds", Help: "Duration of one replication of one rule.",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 600},
		}),
		DeadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_dead_letters_total", Help: "Dead-letter records written, by group.",
		}, []string{"group"}),
		FeedErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_feed_errors_total", Help: "Times the rule follower hit an error and retried.",
		}),
		RulesLoaded: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "spiegel_rules_loaded", Help: "Valid rules loaded, by kind (replicator, on_change).",
		}, []string{"kind"}),
		RulesRejected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "spiegel_rules_rejected", Help: "Rule docs currently rejected as invalid.",
		}),
	}
	reg.MustRegister(m.JobsRun, m.JobDuration, m.WebhookRequests, m.WebhookDuration, m.ChangesPublished, m.OutputGaps,
		m.Replications, m.DocsWritten, m.ReplDuration, m.DeadLetters, m.FeedErrors, m.RulesLoaded, m.RulesRejected)
	return m
}

// JobDone implements worker.Observer.
func (m *Consumer) JobDone(group events.Group, result string, d time.Duration) {
	if m == nil {
		return
	}
	m.JobsRun.WithLabelValues(string(group), result).Inc()
	m.JobDuration.WithLabelValues(string(group)).Observe(d.Seconds())
}

// OutputGap counts one gap of kind (subject, mirror) found in what readers consume.
func (m *Consumer) OutputGap(kind string) {
	if m != nil {
		m.OutputGaps.WithLabelValues(kind).Inc()
	}
}

// FeedError implements rulefeed.Metrics.
func (m *Consumer) FeedError() {
	if m != nil {
		m.FeedErrors.Inc()
	}
}

// RuleStats implements rulefeed.Metrics.
func (m *Consumer) RuleStats(st rules.Stats) {
	if m == nil {
		return
	}
	m.RulesLoaded.WithLabelValues(rules.KindReplicator).Set(float64(st.Replicators))
	m.RulesLoaded.WithLabelValues(rules.KindOnChange).Set(float64(st.OnChanges))
	m.RulesRejected.Set(float64(st.Rejected))
}

// Webhook records one webhook request: status 0 means it failed without an answer.
func (m *Consumer) Webhook(status int, d time.Duration) {
	if m == nil {
		return
	}
	class := "error"
	switch {
	case status >= 200 && status < 300:
		class = "2xx"
	case status >= 300 && status < 400:
		class = "3xx"
	case status >= 400 && status < 500:
		class = "4xx"
	case status >= 500:
		class = "5xx"
	}
	m.WebhookRequests.WithLabelValues(class).Inc()
	m.WebhookDuration.WithLabelValues(class).Observe(d.Seconds())
}

// Replication records one replication of one rule.
func (m *Consumer) Replication(engine, result string, docsWritten int64, d time.Duration) {
	if m == nil {
		return
	}
	m.Replications.WithLabelValues(engine, result).Inc()
	m.DocsWritten.Add(float64(docsWritten))
	m.ReplDuration.Observe(d.Seconds())
}

// DeadLetter counts one dead-letter record of group.
func (m *Consumer) DeadLetter(group events.Group) {
	if m != nil {
		m.DeadLetters.WithLabelValues(string(group)).Inc()
	}
}

// jobsCollector reports pending and in-flight jobs of every group from consumer info at scrape
// time, so every process shows the queue without a db label.
type jobsCollector struct {
	js      jetstream.JetStream
	stream  string
	pending *prometheus.Desc
	flight  *prometheus.Desc
}

// RegisterJobGauges adds spiegel_jobs_pending and spiegel_jobs_in_flight (per group, read from
// JetStream consumer info on every scrape) to reg.
func RegisterJobGauges(reg prometheus.Registerer, js jetstream.JetStream, workStream string) {
	reg.MustRegister(&jobsCollector{
		js: js, stream: workStream,
		pending: prometheus.NewDesc("spiegel_jobs_pending", "Jobs waiting for a worker, by group.", []string{"group"}, nil),
		flight:  prometheus.NewDesc("spiegel_jobs_in_flight", "Jobs delivered to a worker and not yet acknowledged, by group.", []string{"group"}, nil),
	})
}

func (c *jobsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.flight
}

func (c *jobsCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	for _, g := range events.Groups {
		cons, err := c.js.Consumer(ctx, c.stream, g.ConsumerName())
		if err != nil {
			continue
		}
		info, err := cons.Info(ctx)
		if err != nil {
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(info.NumPending), string(g))
		ch <- prometheus.MustNewConstMetric(c.flight, prometheus.GaugeValue, float64(info.NumAckPending), string(g))
	}
}
