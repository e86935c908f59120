package admin

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// Open is the setup of the admin commands that act on an installation: it connects to
// CouchDB and NATS (maxPending publishes in flight), checks that install has run (the streams and
// the consumers of groups) and reads the rule set once. The caller closes d.NC.
func Open(ctx context.Context, cfg *config.Producer, log *logrus.Logger, maxPending int, groups ...events.Group) (*producer.Conns, *rules.Set, error) {
	d, err := Connect(ctx, cfg, log, maxPending)
	if err != nil {
		return nil, nil, err
	}
	if err := natsjs.CheckInstalled(ctx, d.JS, d.Topo, groups...); err != nil {
		d.NC.Close()
		return nil, nil, err
	}
	set := rules.NewSet()
	rf := &rulefeed.Follower{Couch: d.Couch, DB: d.Cfg.DBName, Set: set, Log: log.WithField("component", "rules")}
	if _, err := rf.Load(ctx); err != nil {
		d.NC.Close()
		return nil, nil, err
	}
	return d, set, nil
}

// Progress counts what EnqueueDBs did so far: dbs scanned, jobs enqueued, and jobs already
// pending (deduplicated).
type Progress struct {
	Scanned, Enqueued, Deduped atomic.Int64
}

// EnqueueDBs publishes a job per matching group for every db accepted by match, settling the
// publishes in windows of 256; it calls report after each window and, once everything is
// settled, with final true.
func EnqueueDBs(ctx context.Context, d *producer.Conns, match func(db string) []events.Group, reason string, pr *Progress, report func(final bool)) error {
	jobs := natsjs.NewJobs(d.JS, d.Topo.Subjects)
	type inflight struct {
		g events.Group
		j events.Job
		f jetstream.PubAckFuture
	}
	var window []inflight
	flush := func() error {
		for _, w := range window {
			var err error
			select {
			case <-w.f.Ok():
			case err = <-w.f.Err():
			case <-ctx.Done():
				return ctx.Err()
			}
			if err != nil {
				// A job pending or running (then with its wakeup marker), or one synchronous
				// retry for a failure.
				var dedup bool
				if natsjs.IsDuplicateJob(err) {
					dedup, err = jobs.MarkAndRetry(ctx, w.g, w.j)
				} else {
					dedup, err = jobs.Offer(ctx, w.g, w.j)
				}
				if err != nil {
					return err
				}
				if dedup {
					pr.Deduped.Add(1)
					continue
				}
			}
			pr.Enqueued.Add(1)
		}
		window = window[:0]
		return nil
	}
	err := d.Couch.EachDB(ctx, func(db string) error {
		pr.Scanned.Add(1)
		for _, g := range match(db) {
			j := events.Job{DB: db, Reason: reason, At: time.Now().UTC()}
			f, err := jobs.PublishAsync(g, j)
			if err != nil {
				return err
			}
			window = append(window, inflight{g, j, f})
		}
		if len(window) >= 256 {
			if err := flush(); err != nil {
				return err
			}
			report(false)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := flush(); err != nil {
		return err
	}
	report(true)
	return nil
}
