// Package metrics defines every Prometheus metric of the service. No label carries a db name:
// with 10,000+ dbs that would explode the series count. Each process owns one registry.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// NewRegistry returns a registry with the Go and process collectors and spiegel_build_info.
func NewRegistry(component string) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	info := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "spiegel_build_info", Help: "Build information; the value is always 1.",
	}, []string{"version", "component"})
	info.WithLabelValues(config.Version, component).Set(1)
	reg.MustRegister(info)
	return reg
}

// Producer holds the producer's metrics. A nil *Producer is valid and records nothing.
type Producer struct {
	FeedEvents         *prometheus.CounterVec
	JobsPublished      *prometheus.CounterVec
	JobsDeduped        *prometheus.CounterVec
	PublishErrors      *prometheus.CounterVec
	FeedPositionAge    prometheus.Gauge
	FeedReconnects     prometheus.Counter
	RulesLoaded        *prometheus.GaugeVec
	RulesRejected      prometheus.Gauge
	SweepEnqueued      prometheus.Counter
	SweepChecks        *prometheus.CounterVec
	HotFeeds           prometheus.Gauge
	HotFeedJobs        prometheus.Counter
	EventsCovered      prometheus.Counter
	HotFeedsOpened     prometheus.Counter
	HotFeedsClosed     *prometheus.CounterVec
	HotFeedsRefused    prometheus.Counter
	HotFeedStreak      prometheus.Gauge
	CheckpointsDropped prometheus.Counter
	ChangeStreamLosses prometheus.Counter
	ReplicasBehind     *prometheus.GaugeVec
}

// NewProducer registers the producer's metrics on reg.
func NewProducer(reg prometheus.Registerer) *Producer {
	m := &Producer{
		FeedEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_feed_events_total", Help: "Db-update events read from the feed, by type (created, updated, deleted).",
		}, []string{"type"}),
		JobsPublished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_jobs_published_total", Help: "Jobs accepted by the work stream, by group.",
		}, []string{"group"}),
		JobsDeduped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_jobs_deduplicated_total", Help: "Job publishes refused because a job for the same (group, db) was pending, by group.",
		}, []string{"group"}),
		PublishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_publish_errors_total", Help: "Job publishes that failed and were retried, by group.",
		}, []string{"group"}),
		FeedPositionAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "spiegel_feed_position_age_seconds", Help: "Seconds since the saved feed position last moved forward or was confirmed current.",
		}),
		FeedReconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_feed_errors_total", Help: "Times the feed or rule follower hit an error and retried.",
		}),
		RulesLoaded: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "spiegel_rules_loaded", Help: "Valid rules loaded, by kind (replicator, on_change).",
		}, []string{"kind"}),
		RulesRejected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "spiegel_rules_rejected", Help: "Rule docs currently rejected as invalid.",
		}),
		SweepEnqueued: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_sweep_dbs_total", Help: "Dbs the reconciliation sweep enqueued: not recorded done at their update_seq.",
		}),
		SweepChecks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_sweep_checks_total", Help: "Dbs whose completion record names other shard copies than their update_seq (a CouchDB cluster), " +
				"asked with one _changes read since the record, by answer (unchanged: not enqueued, changed, failed: enqueued).",
		}, []string{"then"}),
		HotFeeds: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "spiegel_hot_feeds", Help: "Continuous _changes feeds open on busy dbs (at most SPIEGEL_HOT_FEEDS).",
		}),
		HotFeedJobs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_hot_feed_publishes_total", Help: "Publishes of a db's jobs on a change its hot feed delivered.",
		}),
		EventsCovered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_feed_events_covered_total", Help: "Db-update events passed over because the db's hot feed publishes its changes' jobs.",
		}),
		HotFeedsOpened: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_hot_feeds_opened_total", Help: "Hot feeds opened: a db's db-update event came within SPIEGEL_HOT_FEED_IDLE of its previous one.",
		}),
		HotFeedsClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "spiegel_hot_feeds_closed_total", Help: "Hot feeds closed, by reason (idle, failed, db_deleted, no_rule, stopping) and by what the close cost " +
				"(none, checked: one _changes request showed the feed had delivered everything, published: the db's jobs were published again).",
		}, []string{"reason", "then"}),
		HotFeedsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_hot_feeds_refused_total", Help: "Busy dbs that got no hot feed because SPIEGEL_HOT_FEEDS were open.",
		}),
		HotFeedStreak: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "spiegel_hot_feed_streak", Help: "Db-update events in a row, each within SPIEGEL_HOT_FEED_IDLE of the one before, that earn a db a hot feed: " +
				"3, more while the feeds closed lately did not pay (delivered fewer than 2 changes), at most 8.",
		}),
		CheckpointsDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_deleted_db_checkpoints_dropped_total", Help: "Deleted dbs whose cached on_change checkpoints were dropped from the key-value bucket.",
		}),
		ReplicasBehind: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "spiegel_stream_replicas_behind", Help: "Replicas of each of Spiegel's streams (and buckets' streams) that are offline or not current, as the stream's leader reports them. Reported only: Spiegel never changes a stream's replicas.",
		}, []string{"stream"}),
		ChangeStreamLosses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "spiegel_change_stream_losses_total", Help: "Times the sweep found that the changes stream lost messages it had acknowledged (gone, went back, or a message missing in the middle).",
		}),
	}
	reg.MustRegister(m.FeedEvents, m.JobsPublished, m.JobsDeduped, m.PublishErrors, m.FeedPositionAge,
		m.FeedReconnects, m.RulesLoaded, m.RulesRejected, m.SweepEnqueued, m.SweepChecks, m.HotFeeds, m.HotFeedJobs, m.EventsCovered,
		m.HotFeedsOpened, m.HotFeedsClosed, m.HotFeedsRefused, m.HotFeedStreak, m.CheckpointsDropped, m.ChangeStreamLosses,
		m.ReplicasBehind)
	return m
}

// FeedError counts one feed or rule-follower error (rulefeed.Metrics).
func (m *Producer) FeedError() {
	if m != nil {
		m.FeedReconnects.Inc()
	}
}

// RuleStats publishes the rule counts (rulefeed.Metrics).
func (m *Producer) RuleStats(st rules.Stats) {
	if m == nil {
		return
	}
	m.RulesLoaded.WithLabelValues(rules.KindReplicator).Set(float64(st.Replicators))
	m.RulesLoaded.WithLabelValues(rules.KindOnChange).Set(float64(st.OnChanges))
	m.RulesRejected.Set(float64(st.Rejected))
}
