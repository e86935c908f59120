package producer

import (
	"github.com/spiegel-nats/spiegel/pkg/metrics"
)

// producerMetrics adapts the feed's and the position's metrics of metrics.Producer (the
// publishing ones are pkg/publisher's); its zero value records nothing.
type producerMetrics struct{ m *metrics.Producer }

func (p producerMetrics) feedEvent(typ string) {
	if p.m != nil {
		p.m.FeedEvents.WithLabelValues(typ).Inc()
	}
}

func (p producerMetrics) feedError() {
	if p.m != nil {
		p.m.FeedReconnects.Inc()
	}
}

func (p producerMetrics) sweepEnqueued() {
	if p.m != nil {
		p.m.SweepEnqueued.Inc()
	}
}

func (p producerMetrics) sweepChecked(then string) {
	if p.m != nil {
		p.m.SweepChecks.WithLabelValues(then).Inc()
	}
}

func (p producerMetrics) eventCovered() {
	if p.m != nil {
		p.m.EventsCovered.Inc()
	}
}

func (p producerMetrics) checkpointsDropped() {
	if p.m != nil {
		p.m.CheckpointsDropped.Inc()
	}
}

func (p producerMetrics) streamLost() {
	if p.m != nil {
		p.m.ChangeStreamLosses.Inc()
	}
}
