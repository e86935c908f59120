package producer

import (
	"time"

	"github.com/nats-io/nats.go"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// registerService registers the producer's NATS service (spiegel-producer) on nc: its status
// endpoint answers the rules loaded, the feed's source and safe position, the hot feeds, the
// feed positions whose jobs are still being published, and the feed's last error.
func (p *producer) registerService(nc *nats.Conn, prefix string) (*status.Service, error) {
	return status.Register(nc, status.Config{
		Prefix: prefix, Component: status.ComponentProducer, Version: config.Version, Report: p.statusReport,
	})
}

// statusReport fills the producer's status answer. It does no I/O.
func (p *producer) statusReport(rep *status.Report) {
	st := p.rules.Stats()
	rep.Rules = status.RuleCounts{Replicators: st.Replicators, OnChanges: st.OnChanges, Disabled: st.Disabled, Rejected: st.Rejected}
	rep.InFlight = p.pub.InFlight()
	p.feedMu.Lock()
	ps := &status.ProducerState{Source: p.source, FeedOK: p.source != "" && p.feedErr == nil}
	if p.lastErr != nil {
		e := *p.lastErr
		rep.LastError = &e
	}
	if p.streamLoss != nil {
		e := *p.streamLoss
		ps.StreamLoss = &e
	}
	p.feedMu.Unlock()
	ps.Position = p.pub.Safe()
	ps.HotFeeds = p.hot.Count()
	rep.Producer = ps
}

// noteStreamLoss keeps why the changes stream was last found to have lost messages, for status
// answers.
func (p *producer) noteStreamLoss(why string) {
	p.feedMu.Lock()
	p.streamLoss = &status.ErrorNote{At: time.Now().UTC(), Text: why}
	p.feedMu.Unlock()
}
