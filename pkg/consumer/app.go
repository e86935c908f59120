// Package consumer wires what both consumer binaries share: connections to CouchDB and NATS, the
// passwords file (reloaded on SIGHUP), the live rule set, health and metrics, and the job runner.
// A consumer binary supplies only its handler.
package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/passwords"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// onChangeLocalEvery batches the _local writes of an on_change checkpoint: the cache entry moves
// with every page, the _local doc at most every 5 minutes (checkpoint.OnChangeStore.LocalEvery).
// The doc matters only when the cache entry is lost (NATS lost the key-value bucket); then up to
// 5 minutes of the db's changes are acted on again. With 30 s, a db written less often than that
// (at 10,000 dbs: every 100 s) paid a _local write for nearly every change.
//
// onChangeLocalChanges goes further for such a db: its doc, older than 5 minutes, still waits
// until it trails the entry by 20 changes (checkpoint.OnChangeStore.LocalChanges). Without it a
// db written every few minutes still wrote its doc with almost every change (0.59 _local writes
// per written doc at 10,000 dbs). Should the entry be lost, each (rule, db) acts on at most 20
// changes, or 5 minutes of them, a second time.
const (
	onChangeLocalEvery   = 5 * time.Minute
	onChangeLocalChanges = 20
)

// App is one consumer process's shared state. Build it with Open, hand App.Deps to the
// handler, then call Run.
type App struct {
	Deps

	log       logrus.FieldLogger
	nc        *nats.Conn
	topology  natsjs.Topology
	registry  *prometheus.Registry
	spiegelDB string
	probe     *couch.Client // the readiness check's: outside the cap on requests
	cfg       *config.Consumer
	group     events.Group
	follower  *rulefeed.Follower
	rulesSeq  string
	rulesWait time.Duration       // awaitRules' bound (rulesWait; tests shorten it)
	done      *reconcile.Recorder // records each successful job for the producer's sweep

	// StatusExtra, when set before Run, adds the binary's own parts to the process's status
	// answers (see status.Config.Report).
	StatusExtra func(*status.Report)
}

// Deps is what a consumer's handler may use: the parts of the process it needs, nothing of how
// the process runs (NATS connection, topology, registry).
type Deps struct {
	Log         logrus.FieldLogger
	Couch       *couch.Client
	Rules       *rules.Set                // the live rule set
	Passwords   *passwords.File           // reloaded on SIGHUP
	Checkpoints *checkpoint.OnChangeStore // checkpoints of on_change rules (onchange only)
	DeadLetters *worker.DeadLetters       // the dead-letter stream
	Metrics     *metrics.Consumer
	JS          jetstream.JetStream // publishes of subject rules
	// Status keeps the per-rule figures of the process's status answers: handlers record every
	// rule's run in a db (status.Recorder.RuleRun).
	Status *status.Recorder
}

// Options are what a binary adds to Open.
type Options struct {
	// Rules is the policy rules are parsed under; its SubjectPrefix is set from the config.
	Rules rules.Policy
}

// Open connects to CouchDB and NATS, checks that install has run, loads the passwords file and
// the rules. A missing installation is an error wrapping natsjs.ErrNotInstalled.
func Open(ctx context.Context, cfg *config.Consumer, group events.Group, log logrus.FieldLogger) (*App, error) {
	return OpenWith(ctx, cfg, group, log, Options{})
}

// OpenWith is Open with the binary's options.
func OpenWith(ctx context.Context, cfg *config.Consumer, group events.Group, log logrus.FieldLogger, o Options) (*App, error) {
	o.Rules.SubjectPrefix = cfg.SubjectPrefix
	ccfg := couch.Config{
		URL: cfg.CouchDBURL, CAFile: cfg.CouchDBCAFile, InsecureSkipVerify: cfg.CouchDBInsecureTLS, RequestTimeout: cfg.CouchDBTimeout,
		MaxConns: cfg.CouchDBMaxConns.For(cfg.Concurrency),
	}
	cc, err := couch.New(ccfg, log.WithField("component", "couch"))
	if err != nil {
		return nil, err
	}
	// The readiness check has a connection of its own: behind a cap, a slow CouchDB and a full
	// pool of jobs' requests would make it time out, and an orchestrator restart a busy process.
	probe := cc
	if ccfg.MaxConns > 0 {
		ccfg.MaxConns = 0
		if probe, err = couch.New(ccfg, log.WithField("component", "couch")); err != nil {
			return nil, err
		}
	}
	pw, err := passwords.Load(cfg.PasswordsFile)
	if err != nil {
		return nil, err
	}
	nopts := natsjs.OptionsFrom(cfg.NATS, "spiegel-"+group.ConsumerName())
	nopts.NoReconnectBuffer = true // nothing a job sends may reach NATS after its lease ran out
	nc, err := natsjs.Connect(ctx, nopts, log.WithField("component", "nats"))
	if err != nil {
		return nil, err
	}
	// Subject rules pipeline their publishes; an answer that never comes must not keep its
	// future forever.
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(time.Minute))
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("open JetStream: %w", err)
	}
	topo := natsjs.DefaultTopology(cfg.SubjectPrefix)
	topo.Replicas, topo.AckWait = cfg.StreamReplicas, cfg.AckWait
	fail := func(err error) (*App, error) { nc.Close(); return nil, err }
	nlog := log.WithField("component", "nats")
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) error {
		return natsjs.CheckInstalled(ctx, js, topo, group)
	}); err != nil {
		return fail(err)
	}
	if _, err := cc.DBInfo(ctx, cfg.DBName); errors.Is(err, couch.ErrNotFound) {
		return fail(fmt.Errorf("the spiegel db %q does not exist: %w", cfg.DBName, natsjs.ErrNotInstalled))
	}
	var doneKV jetstream.KeyValue
	if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) (err error) {
		doneKV, err = natsjs.DoneBucket(ctx, js, topo)
		return err
	}); err != nil {
		return fail(err)
	}
	reg := metrics.NewRegistry(group.ConsumerName())
	m := metrics.NewConsumer(reg)
	metrics.RegisterJobGauges(reg, js, topo.Subjects.WorkStream())
	var checkpoints *checkpoint.OnChangeStore
	if group == events.GroupOnChange {
		var kv jetstream.KeyValue
		if err := natsjs.AwaitInstalled(ctx, nlog, func(ctx context.Context) (err error) {
			kv, err = natsjs.OnChangeBucket(ctx, js, topo)
			return err
		}); err != nil {
			return fail(err)
		}
		checkpoints = checkpoint.NewOnChangeStore(cc, kv)
		checkpoints.LocalEvery, checkpoints.LocalChanges = onChangeLocalEvery, onChangeLocalChanges
		// Earlier releases kept the checkpoints in the spiegel db: move them, once. A failure
		// leaves them for the next start (until then those rules start over in those dbs).
		if n, err := checkpoints.MigrateLegacy(ctx, cfg.DBName); err != nil {
			log.WithError(err).Warn("move the on_change checkpoints of an earlier release out of the spiegel db; retried at the next start")
		} else if n > 0 {
			log.WithField("checkpoints", n).Info("moved the on_change checkpoints of an earlier release into _local docs of their dbs")
		}
	}
	a := &App{
		Deps: Deps{
			Log: log, Couch: cc, Passwords: pw, Rules: rules.NewSetWith(o.Rules), Checkpoints: checkpoints,
			DeadLetters: worker.NewDeadLetters(js, topo.Subjects), Metrics: m, JS: js, Status: status.NewRecorder(),
		},
		log: log, nc: nc, topology: topo, registry: reg, spiegelDB: cfg.DBName, cfg: cfg, group: group, probe: probe,
		done: reconcile.NewRecorder(cc, reconcile.New(js, doneKV), log.WithField("component", "reconcile")),
	}
	a.follower = &rulefeed.Follower{Couch: cc, DB: cfg.DBName, Set: a.Rules, Log: log.WithField("component", "rules"), Metrics: m}
	if a.rulesSeq, err = a.loadRules(ctx); err != nil {
		return fail(err)
	}
	st := a.Rules.Stats()
	log.WithFields(logrus.Fields{"replicators": st.Replicators, "on_changes": st.OnChanges, "rejected": st.Rejected}).Info("rules loaded")
	return a, nil
}

// Run follows the rules, serves health and metrics on httpAddr, reloads the passwords file on
// SIGHUP, registers the process's NATS service (status.Register: spiegel-replicator or
// spiegel-onchange), and runs h on the group's jobs until ctx ends; then it lets running jobs
// finish within the grace period, naks the rest, stops the service and drains NATS. Each
// successful job records the position of its db's feed that h vouched for, for the producer's
// reconciliation sweep (reconcile.Recorder.Wrap, reconcile.Vouch).
func (a *App) Run(ctx context.Context, httpAddr string, h worker.Handler) error {
	a.done.Rules = a.Rules.Fingerprint
	h = a.awaitRules(a.done.Wrap(h))
	defer func() { _ = a.nc.Drain() }()
	var wg sync.WaitGroup
	defer wg.Wait()
	bgCtx, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()

	wg.Add(4)
	go func() { defer wg.Done(); a.follower.Follow(bgCtx, a.rulesSeq) }()
	go func() { defer wg.Done(); a.reloadOnHUP(bgCtx) }()
	srv := health.New(httpAddr, a.registry, a.readiness(), a.log.WithField("component", "http"))
	go func() {
		defer wg.Done()
		if err := srv.Run(bgCtx); err != nil {
			a.log.WithError(err).Error("health and metrics listener failed")
		}
	}()
	go func() {
		defer wg.Done()
		if err := health.RunPprof(bgCtx, a.cfg.PprofAddr); err != nil {
			a.log.WithError(err).Error("profiling listener (SPIEGEL_PPROF_ADDR) failed")
		}
	}()

	// The consumer lookup waits out a JetStream that does not answer (a leader election, a
	// node restarting) instead of exiting: SPEC §4.8.
	var runner *worker.Runner
	err := natsjs.AwaitInstalled(ctx, a.log.WithField("component", "nats"), func(context.Context) (err error) {
		runner, err = worker.New(a.JS, a.topology.Subjects, worker.Config{
			Group: a.group, Concurrency: a.cfg.Concurrency, AckWait: a.cfg.AckWait, Grace: a.cfg.ShutdownGrace,
			Retry:    backoff.Policy{Initial: a.cfg.RetryInitial, Max: a.cfg.RetryMax, Multiplier: 2, Jitter: 0.2},
			Observer: observers{a.Metrics, a.Status},
			Drained:  a.Couch.CloseIdleConnections, // a burst's extra connections are not kept for the idle timeout
		}, h, a.log.WithField("component", "worker"))
		return err
	})
	if err != nil && ctx.Err() != nil {
		return nil // stopped while waiting: nothing was running
	}
	if err != nil {
		return err
	}
	svc, err := status.Register(a.nc, status.Config{
		Prefix: a.cfg.SubjectPrefix, Component: a.group.ConsumerName(), Version: config.Version,
		Report: func(rep *status.Report) {
			st := a.Rules.Stats()
			rep.Rules = status.RuleCounts{Replicators: st.Replicators, OnChanges: st.OnChanges, Disabled: st.Disabled, Rejected: st.Rejected}
			rep.InFlight = runner.InFlight()
			a.Status.Fill(rep)
			if a.StatusExtra != nil {
				a.StatusExtra(rep)
			}
		},
	})
	if err != nil {
		return err
	}
	defer func() { _ = svc.Stop() }()
	a.log.WithFields(logrus.Fields{"group": a.group, "concurrency": a.cfg.Concurrency}).Info("consumer running")
	err = runner.Run(ctx)
	a.log.WithField("group", a.group).Info("consumer stopped")
	return err
}

// rulesWait bounds how long a job waits for this process's rule feed to apply the rules the job
// was published with; then it is retried later (a transient failure).
const rulesWait = 10 * time.Second

// awaitRules returns h run only once this process's rule set has applied every rule change the
// job's publisher had (events.Job Rules, rulefeed.Follower.Await). Without it, a consumer whose
// rule feed lagged ran a new rule's catch-up job with its old rules and acked it: the rule
// skipped the db until its next write, and the completion record said the db was done.
func (a *App) awaitRules(h worker.Handler) worker.Handler {
	return func(ctx context.Context, job *worker.Job) error {
		if err := a.follower.Await(ctx, job.Rules, cmp.Or(a.rulesWait, rulesWait)); err != nil {
			return fmt.Errorf("job of %s: %w", job.DB, err)
		}
		return h(ctx, job)
	}
}

// observers tells every Observer of the list about each job.
type observers []worker.Observer

func (o observers) JobDone(group events.Group, result string, d time.Duration) {
	for _, x := range o {
		x.JobDone(group, result, d)
	}
}

// reloadOnHUP reloads the passwords file on SIGHUP; a broken file keeps the old passwords.
func (a *App) reloadOnHUP(ctx context.Context) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			if err := a.Passwords.Reload(); err != nil {
				a.log.WithError(err).Error("reload passwords file; keeping the previous passwords")
				continue
			}
			a.log.Info("passwords file reloaded")
		}
	}
}

func (a *App) readiness() map[string]health.Check {
	return health.Dependencies(func(ctx context.Context) error {
		_, err := a.probe.DBInfo(ctx, a.spiegelDB)
		return err
	}, a.nc, "consumer", func(ctx context.Context) error {
		return natsjs.CheckInstalled(ctx, a.JS, a.topology, a.group)
	})
}

// Timeout returns the smaller positive of a and b.
func Timeout(a, b time.Duration) time.Duration {
	if a <= 0 || b > 0 && b < a {
		return b
	}
	return a
}

// loadRules loads the rules, waiting out a CouchDB that does not answer (a restart, an outage):
// a daemon never exits on a transient error (SPEC §4.8). Any other error (refused credentials,
// a missing spiegel db) or the end of ctx is returned.
func (a *App) loadRules(ctx context.Context) (string, error) {
	for attempt := 1; ; attempt++ {
		seq, err := a.follower.Load(ctx)
		if err == nil || ctx.Err() != nil || couch.Classify(err) != couch.Transient {
			return seq, err
		}
		delay := backoff.Default.Delay(attempt)
		a.log.WithError(err).WithFields(logrus.Fields{"attempt": attempt, "delay": delay.String()}).
			Warn("CouchDB did not answer while the rules were loading: retrying")
		if err := backoff.Sleep(ctx, delay); err != nil {
			return "", fmt.Errorf("load rules: %w", err)
		}
	}
}
