// Package producer is the producer's engine (SPEC §4): it follows CouchDB's db-updates feed and
// hands each event's jobs to the publish pipeline (pkg/publisher), saves the position the
// pipeline calls safe, sweeps for what the feed dropped, and enqueues the existing dbs of new
// rules. Run wires it with its connections, metrics, NATS service and health listener; the
// producer binary (producer/) runs it; what its admin commands do is pkg/admin.
//
// One db-updates event, top-down: Run starts runFeed (producer.go), which reads the feed
// (couch.UpdatesFeed) and calls handle for each event; handle asks the rules which groups want
// the db and enqueues their jobs (publisher.Pipeline.Enqueue), or passes over an event a hot feed
// stands for (publisher.HotFeeds.Cover, Pipeline.Covered); the pipeline publishes each job to the
// work stream (natsjs.Jobs) and, once JetStream acknowledged it, moves the safe position that
// runSaver stores in the spiegel db (checkpoint.Store).
package producer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"golang.org/x/time/rate"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/publisher"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// Conns are the connections every command of the producer binary needs.
type Conns struct {
	Cfg   *config.Producer
	Log   *logrus.Logger
	Couch *couch.Client
	NC    *nats.Conn
	JS    jetstream.JetStream
	Topo  natsjs.Topology
}

func connect(ctx context.Context, cfg *config.Producer, log *logrus.Logger, maxPending int) (*Conns, error) {
	cc, err := NewCouch(cfg, log)
	if err != nil {
		return nil, err
	}
	nc, err := natsjs.Connect(ctx, natsjs.OptionsFrom(cfg.NATS, "spiegel-producer"), log.WithField("component", "nats"))
	if err != nil {
		return nil, err
	}
	return NewConns(cfg, log, cc, nc, maxPending)
}

// producerConns is the producer's cap on CouchDB connections for requests under
// SPIEGEL_COUCHDB_MAX_CONNECTIONS=auto: none. Its requests are few at a time by design (a sweep
// sends at most 8 at once, then rule loads and position saves), so a cap would only queue its
// readiness check behind a sweep.
const producerConns = 0

// NewCouch returns the CouchDB client of cfg.
func NewCouch(cfg *config.Producer, log *logrus.Logger) (*couch.Client, error) {
	return couch.New(couch.Config{
		URL: cfg.CouchDBURL, CAFile: cfg.CouchDBCAFile, InsecureSkipVerify: cfg.CouchDBInsecureTLS, RequestTimeout: cfg.CouchDBTimeout,
		MaxConns: cfg.CouchDBMaxConns.Or(producerConns),
	}, log.WithField("component", "couch"))
}

// NewConns completes the connections of cfg over cc and nc (closed on error), with at most
// maxPending asynchronous publishes in flight.
func NewConns(cfg *config.Producer, log *logrus.Logger, cc *couch.Client, nc *nats.Conn, maxPending int) (*Conns, error) {
	// An answer that never comes must not keep its publish among the maxPending for good
	// (the pipeline publishes it again after the same time, see publisher.Pipeline).
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(maxPending),
		jetstream.WithPublishAsyncTimeout(publisher.AckTimeout))
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("open JetStream: %w", err)
	}
	topo := natsjs.DefaultTopology(cfg.SubjectPrefix)
	topo.Replicas = cfg.StreamReplicas
	topo.AckWait = cfg.AckWait
	return &Conns{Cfg: cfg, Log: log, Couch: cc, NC: nc, JS: js, Topo: topo}, nil
}

// Run runs the producer until ctx ends (SPEC §4).
func Run(ctx context.Context, cfg *config.Producer, log *logrus.Logger) error {
	d, err := connect(ctx, cfg, log, 2*cfg.MaxInflight+64)
	if err != nil {
		return err
	}
	defer func() { _ = d.NC.Drain() }()
	nlog := log.WithField("component", "nats")
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) error {
		return natsjs.CheckInstalled(ctx, d.JS, d.Topo)
	}); err != nil {
		return err
	}
	if _, err := d.Couch.DBInfo(ctx, cfg.DBName); errors.Is(err, couch.ErrNotFound) {
		return fmt.Errorf("the spiegel db %q does not exist: %w", cfg.DBName, natsjs.ErrNotInstalled)
	}

	var kv jetstream.KeyValue
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) (err error) {
		kv, err = natsjs.OnChangeBucket(ctx, d.JS, d.Topo)
		return err
	}); err != nil {
		return err
	}
	var doneKV jetstream.KeyValue
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) (err error) {
		doneKV, err = natsjs.DoneBucket(ctx, d.JS, d.Topo)
		return err
	}); err != nil {
		return err
	}

	reg := metrics.NewRegistry("producer")
	pm := metrics.NewProducer(reg)
	metrics.RegisterJobGauges(reg, d.JS, d.Topo.Subjects.WorkStream())
	plog := log.WithField("component", "producer")
	p := &producer{
		cfg: producerSettings{
			SpiegelDB: cfg.DBName, Source: cfg.Source, Heartbeat: cfg.FeedHeartbeat,
			PollInterval: cfg.PollInterval, SweepInterval: cfg.SweepInterval, SaveInterval: cfg.PositionSaveInterval,
			Grace: cfg.ShutdownGrace,
		},
		couch:   d.Couch,
		store:   checkpoint.NewStore(d.Couch, cfg.DBName),
		rules:   rules.NewSet(),
		log:     plog,
		metrics: producerMetrics{m: pm},
		resync:  make(chan struct{}, 1),
		feedUp:  make(chan struct{}),
		asks:    rate.NewLimiter(sweepAsksPerSecond, sweepAsksPerSecond),
	}
	dropper, err := checkpoint.NewCacheDropper(ctx, d.JS, kv)
	if err != nil {
		return err
	}
	p.deleted = newDeletedDBs(dropper, p.metrics, plog)
	p.removedRules = newDeletedDBs(ruleDrops{dropper}, producerMetrics{}, plog.WithField("drops", "rule"))
	records := reconcile.New(d.JS, doneKV)
	p.done = &doneRecords{records: records, ensure: func(ctx context.Context) error { return natsjs.EnsureDoneBucket(ctx, d.JS, d.Topo) }}
	p.undone = newDeletedDBs(records, producerMetrics{}, plog.WithField("records", "done"))
	p.changes = &streamWatch{js: d.JS, name: d.Topo.Subjects.ChangesStream()}
	// Every job carries the rule set it was published with (events.Job Rules): a consumer whose
	// own rule feed lags waits for it before it runs the job (rulefeed.Follower.Await).
	rf := &rulefeed.Follower{Couch: d.Couch, DB: cfg.DBName, Set: p.rules, Log: plog.WithField("component", "rules"), Metrics: pm,
		OnAdded: p.enqueueMatching, OnRemoved: p.ruleRemoved}
	p.pub = publisher.New(natsjs.NewJobs(d.JS, d.Topo.Subjects).WithRules(rf.AppliedSeq), cfg.MaxInflight, pm, plog)
	if cfg.HotFeeds > 0 {
		p.hot = publisher.NewHotFeeds(d.Couch, p.pub, func(db string) []events.Group { return p.rules.Groups(db).Groups() },
			cfg.HotFeeds, cfg.HotFeedIdle, cfg.FeedHeartbeat, pm, log.WithField("component", "hot"))
	}

	svc, err := p.registerService(d.NC, cfg.SubjectPrefix)
	if err != nil {
		return err
	}
	defer func() { _ = svc.Stop() }()

	srv := health.New(cfg.HTTPAddr, reg, readiness(d, cfg.DBName, p.feedHealth), log.WithField("component", "http"))
	var wg sync.WaitGroup
	httpCtx, stopHTTP := context.WithCancel(context.WithoutCancel(ctx))
	defer stopHTTP()
	wg.Add(2)
	go func() {
		defer wg.Done()
		if err := srv.Run(httpCtx); err != nil {
			plog.WithError(err).Error("health and metrics listener failed")
		}
	}()
	go func() {
		defer wg.Done()
		if err := health.RunPprof(httpCtx, cfg.PprofAddr); err != nil {
			plog.WithError(err).Error("profiling listener (SPIEGEL_PPROF_ADDR) failed")
		}
	}()

	pos, since, first, err := p.startPosition(ctx)
	if err != nil {
		return err
	}
	if first {
		plog.Info("first start (no saved position): the feed starts at the server's current position; once it runs, every db a rule matches is enqueued")
	}
	p.pub.SetSafe(since)
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); p.pub.Run(ctx, cfg.ShutdownGrace) }()

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
	feedWG.Add(7)
	go func() { defer feedWG.Done(); p.deleted.Run(ctx) }()
	go func() { defer feedWG.Done(); p.removedRules.Run(ctx) }()
	go func() { defer feedWG.Done(); p.undone.Run(ctx) }()
	go func() {
		defer feedWG.Done()
		// Rules changed while no producer ran: enqueue their existing dbs, then follow live. On a
		// first start every rule is new, and the feed starts at the server's current position:
		// the catch-up waits for it, so that a write in between is in one or the other.
		if first && p.waitFeed(ctx) != nil {
			return
		}
		rf.CatchUp(ctx, pos.RulesSeq, rulesSeq)
		rf.Follow(ctx, rulesSeq)
	}()
	go func() { defer feedWG.Done(); p.runSweepIfFeed(ctx) }()
	go func() { defer feedWG.Done(); p.runResyncs(ctx) }()
	go func() { defer feedWG.Done(); p.runFeed(ctx, since) }()
	sub := d.Topo.Subjects
	ours := []string{sub.WorkStream(), sub.WakeupStream(), sub.DeadLetterStream(), sub.ChangesStream(),
		"KV_" + sub.OnChangeBucket(), "KV_" + sub.DoneBucket()}
	feedWG.Add(1)
	go func() {
		defer feedWG.Done()
		watchReplicas(ctx, d.JS, ours, replicaInterval, func(s string, n int) { pm.ReplicasBehind.WithLabelValues(s).Set(float64(n)) }, plog)
	}()
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
func readiness(d *Conns, spiegelDB string, feed health.Check) map[string]health.Check {
	checks := health.Dependencies(func(ctx context.Context) error {
		_, err := d.Couch.DBInfo(ctx, spiegelDB)
		return err
	}, d.NC, "stream", func(ctx context.Context) error {
		return natsjs.CheckInstalled(ctx, d.JS, d.Topo, events.Groups...)
	})
	checks["feed"] = feed
	return checks
}
