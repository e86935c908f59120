package main

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// deps are the connections every command of the producer binary needs.
type deps struct {
	cfg   *config.Producer
	log   *logrus.Logger
	couch *couch.Client
	nc    *nats.Conn
	js    jetstream.JetStream
	topo  natsjs.Topology
}

func connect(ctx context.Context, cfg *config.Producer, log *logrus.Logger, maxPending int) (*deps, error) {
	cc, err := newCouch(cfg, log)
	if err != nil {
		return nil, err
	}
	nc, err := natsjs.Connect(ctx, natsjs.OptionsFrom(cfg.NATS, "spiegel-producer"), log.WithField("component", "nats"))
	if err != nil {
		return nil, err
	}
	return newDeps(cfg, log, cc, nc, maxPending)
}

func newCouch(cfg *config.Producer, log *logrus.Logger) (*couch.Client, error) {
	return couch.New(couch.Config{
		URL: cfg.CouchDBURL, CAFile: cfg.CouchDBCAFile, InsecureSkipVerify: cfg.CouchDBInsecureTLS, RequestTimeout: cfg.CouchDBTimeout,
	}, log.WithField("component", "couch"))
}

// newDeps completes the connections of cfg over cc and nc (closed on error).
func newDeps(cfg *config.Producer, log *logrus.Logger, cc *couch.Client, nc *nats.Conn, maxPending int) (*deps, error) {
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(maxPending))
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("open JetStream: %w", err)
	}
	topo := natsjs.DefaultTopology(cfg.SubjectPrefix)
	topo.Replicas = cfg.StreamReplicas
	topo.AckWait = cfg.AckWait
	return &deps{cfg: cfg, log: log, couch: cc, nc: nc, js: js, topo: topo}, nil
}

// runProducer runs the producer until ctx ends (SPEC §4).
func runProducer(ctx context.Context, cfg *config.Producer, log *logrus.Logger) error {
	d, err := connect(ctx, cfg, log, 2*cfg.MaxInflight+64)
	if err != nil {
		return err
	}
	defer func() { _ = d.nc.Drain() }()
	nlog := log.WithField("component", "nats")
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) error {
		return natsjs.CheckInstalled(ctx, d.js, d.topo)
	}); err != nil {
		return err
	}
	if _, err := d.couch.DBInfo(ctx, cfg.DBName); errors.Is(err, couch.ErrNotFound) {
		return fmt.Errorf("the spiegel db %q does not exist: %w", cfg.DBName, natsjs.ErrNotInstalled)
	}

	var kv jetstream.KeyValue
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) (err error) {
		kv, err = natsjs.OnChangeBucket(ctx, d.js, d.topo)
		return err
	}); err != nil {
		return err
	}
	var doneKV jetstream.KeyValue
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) (err error) {
		doneKV, err = natsjs.DoneBucket(ctx, d.js, d.topo)
		return err
	}); err != nil {
		return err
	}

	reg := metrics.NewRegistry("producer")
	pm := metrics.NewProducer(reg)
	metrics.RegisterJobGauges(reg, d.js, d.topo.Subjects.WorkStream())
	plog := log.WithField("component", "producer")
	p := &producer{
		cfg: producerSettings{
			SpiegelDB: cfg.DBName, Source: cfg.Source, Start: cfg.Start, Heartbeat: cfg.FeedHeartbeat,
			PollInterval: cfg.PollInterval, SweepInterval: cfg.SweepInterval, SaveInterval: cfg.PositionSaveInterval,
			Grace: cfg.ShutdownGrace,
		},
		couch:   d.couch,
		store:   checkpoint.NewStore(d.couch, cfg.DBName),
		rules:   rules.NewSet(),
		log:     plog,
		metrics: producerMetrics{m: pm},
		resync:  make(chan struct{}, 1),
	}
	dropper, err := checkpoint.NewCacheDropper(ctx, d.js, kv)
	if err != nil {
		return err
	}
	p.deleted = newDeletedDBs(dropper, p.metrics, plog)
	records := reconcile.New(d.js, doneKV)
	p.done = &doneRecords{records: records, ensure: func(ctx context.Context) error { return natsjs.EnsureDoneBucket(ctx, d.js, d.topo) }}
	p.undone = newDeletedDBs(records, producerMetrics{}, plog.WithField("records", "done"))
	p.pub = newPublisher(natsjs.NewJobs(d.js, d.topo.Subjects), cfg.MaxInflight, p.metrics, plog)
	if cfg.HotFeeds > 0 {
		p.hot = newHotFeeds(d.couch, p.pub, func(db string) []events.Group { return p.rules.Groups(db).Groups() },
			cfg.HotFeeds, cfg.HotFeedIdle, cfg.FeedHeartbeat, p.metrics, log.WithField("component", "hot"))
	}

	svc, err := p.registerService(d.nc, cfg.SubjectPrefix)
	if err != nil {
		return err
	}
	defer func() { _ = svc.Stop() }()

	srv := health.New(cfg.HTTPAddr, reg, readiness(d, cfg.DBName, p.feedHealth), log.WithField("component", "http"))
	var wg sync.WaitGroup
	httpCtx, stopHTTP := context.WithCancel(context.WithoutCancel(ctx))
	defer stopHTTP()
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := srv.Run(httpCtx); err != nil {
			plog.WithError(err).Error("health and metrics listener failed")
		}
	}()

	pos, since, err := p.startPosition(ctx)
	if err != nil {
		return err
	}
	p.pub.SetSafe(since)
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); p.pub.Run(ctx, cfg.ShutdownGrace) }()

	rf := &rulefeed.Follower{Couch: d.couch, DB: cfg.DBName, Set: p.rules, Log: plog.WithField("component", "rules"), Metrics: pm,
		OnAdded: p.enqueueMatching}
	rulesSeq, err := rf.Load(ctx)
	if err != nil {
		return err
	}
	st := p.rules.Stats()
	plog.WithFields(logrus.Fields{"replicators": st.Replicators, "on_changes": st.OnChanges, "rejected": st.Rejected}).Info("rules loaded")

	var feedWG sync.WaitGroup
	if p.hot != nil {
		feedWG.Add(1)
		go func() { defer feedWG.Done(); p.hot.Run(ctx) }()
	}
	feedWG.Add(6)
	go func() { defer feedWG.Done(); p.deleted.Run(ctx) }()
	go func() { defer feedWG.Done(); p.undone.Run(ctx) }()
	go func() {
		defer feedWG.Done()
		// Rules changed while no producer ran: enqueue their existing dbs, then follow live.
		rf.CatchUp(ctx, pos.RulesSeq, rulesSeq)
		rf.Follow(ctx, rulesSeq)
	}()
	go func() { defer feedWG.Done(); p.runSweepIfFeed(ctx) }()
	go func() { defer feedWG.Done(); p.runResyncs(ctx) }()
	go func() { defer feedWG.Done(); p.runFeed(ctx, since) }()
	saverCtx, stopSaver := context.WithCancel(ctx)
	saverDone := make(chan struct{})
	go func() {
		defer close(saverDone)
		p.runSaver(saverCtx, rf.EnqueuedSeq)
	}()

	<-ctx.Done()
	feedWG.Wait()
	stopSaver()
	<-saverDone
	<-pubDone // settles what was in flight, within the grace period
	finalCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownGrace)
	defer cancel()
	p.save(finalCtx, rf.EnqueuedSeq())
	stopHTTP()
	wg.Wait()
	plog.WithField("seq", p.pub.Safe()).Info("producer stopped")
	return nil
}

// readiness checks CouchDB, NATS, the work stream and the db-updates feed.
func readiness(d *deps, spiegelDB string, feed health.Check) map[string]health.Check {
	checks := health.Dependencies(func(ctx context.Context) error {
		_, err := d.couch.DBInfo(ctx, spiegelDB)
		return err
	}, d.nc, "stream", func(ctx context.Context) error {
		return natsjs.CheckInstalled(ctx, d.js, d.topo, events.Groups...)
	})
	checks["feed"] = feed
	return checks
}
