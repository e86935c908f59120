package publisher

import (
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// producerMetrics adapts the publishing and hot-feed metrics of metrics.Producer; its zero value
// records nothing.
type producerMetrics struct{ m *metrics.Producer }

func (p producerMetrics) published(g events.Group) {
	if p.m != nil {
		p.m.JobsPublished.WithLabelValues(string(g)).Inc()
	}
}

func (p producerMetrics) deduplicated(g events.Group) {
	if p.m != nil {
		p.m.JobsDeduped.WithLabelValues(string(g)).Inc()
	}
}

// settled counts a job that is stored (deduplicated false) or stood for by the pending one.
func (p producerMetrics) settled(g events.Group, deduplicated bool) {
	if deduplicated {
		p.deduplicated(g)
	} else {
		p.published(g)
	}
}

func (p producerMetrics) publishError(g events.Group) {
	if p.m != nil {
		p.m.PublishErrors.WithLabelValues(string(g)).Inc()
	}
}

func (p producerMetrics) feedsOpen(n int) {
	if p.m != nil {
		p.m.HotFeeds.Set(float64(n))
	}
}

func (p producerMetrics) hotFeedJob() {
	if p.m != nil {
		p.m.HotFeedJobs.Inc()
	}
}

func (p producerMetrics) hotFeedOpened() {
	if p.m != nil {
		p.m.HotFeedsOpened.Inc()
	}
}

// hotFeedClosed counts a closed feed by why it closed and what its close cost (CloseThen*).
func (p producerMetrics) hotFeedClosed(why, then string) {
	if p.m != nil {
		p.m.HotFeedsClosed.WithLabelValues(why, then).Inc()
	}
}

func (p producerMetrics) hotFeedStreak(n int) {
	if p.m != nil {
		p.m.HotFeedStreak.Set(float64(n))
	}
}

func (p producerMetrics) hotFeedRefused() {
	if p.m != nil {
		p.m.HotFeedsRefused.Inc()
	}
}
