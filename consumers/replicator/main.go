// Command replicator runs the replicate jobs of the work queue: for each db with changes, a
// one-shot replication per matching replicator rule (SPEC §2.1, §5.2).
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/replicate"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

const usage = `replicator — Spiegel for NATS: replicate each changed db with its replicator rules

Usage:
  replicator               run the consumer (configuration from the environment below)
  replicator healthcheck   exit 0 when this replicator's /healthz answers [URL]
                           (the container health check)
  replicator version       the version, commit, commit time, dirty flag, Go version [--json]

Flags: --help, --help-all (the advanced variables too), --version. An unknown flag or command
exits 2; unknown SPIEGEL_* variables are warned about at start.`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	var cfg config.Replicator
	code, done := config.ConsumerFront("replicator", usage, os.Args[1:], &cfg, os.Stdout, os.Stderr)
	if !done {
		code = consumer.Main(ctx, "replicator", usage, os.Args[1:], os.Stdout, os.Stderr, &cfg,
			func(ctx context.Context, log *logrus.Logger) error {
				config.LogStart(log, "replicator", &cfg, os.Environ())
				return run(ctx, &cfg, log)
			})
	}
	stop()
	os.Exit(code)
}

// run opens the consumer app and runs the replicate handler until ctx ends.
func run(ctx context.Context, cfg *config.Replicator, log *logrus.Logger) error {
	app, err := consumer.Open(ctx, &cfg.Consumer, events.GroupReplicate, log.WithField("component", "replicator"))
	if err != nil {
		return err
	}
	app.StatusExtra = func(rep *status.Report) { rep.DefaultEngine = cfg.Engine }
	return app.Run(ctx, cfg.HTTPAddr, newHandler(app.Deps, cfg).handle)
}

// newHandler wires the handler to the app's connections: both engines share the CouchDB
// client's transport (TLS settings, connection pool).
func newHandler(app consumer.Deps, cfg *config.Replicator) *replicator {
	return &replicator{
		dbs: app.Couch, rules: app.Rules, deadLetters: app.DeadLetters, metrics: app.Metrics, status: app.Status,
		log: app.Log.WithField("component", "replicator"), base: app.Couch.BaseURL(), passwords: app.Passwords,
		engines: map[string]engine{
			rules.EngineCouchDB: couchEngine{server: app.Couch},
			rules.EngineNative: nativeEngine{hc: app.Couch.HTTPClient(), shc: app.Couch.StreamHTTPClient(), log: app.Log.WithField("component", "replicate"),
				checkpointDefer: nativeCheckpointDefer, checkpoints: replicate.NewCheckpointCache(nativeCheckpointCacheAge, nativeCheckpointCacheSize),
				fence: &kvFence{js: app.JS, topo: natsjs.DefaultTopology(cfg.SubjectPrefix)}},
		},
		defaultEngine: cfg.Engine, timeout: cfg.ReplicationTimeout,
	}
}
