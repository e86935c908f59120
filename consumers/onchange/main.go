// Command onchange is the on_change consumer of Spiegel for NATS (SPEC §5.3): for every db with
// new changes it runs each matching on_change rule over the changes after the rule's checkpoint,
// calling its webhook or publishing each change to NATS, with retries, dead letters and
// at-least-once checkpoints.
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
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

const usage = `onchange runs the on_change rules of the spiegel db: for every changed database it calls
each matching rule's webhook (or publishes the change to NATS) for every change, in feed order,
with per-(rule, db) checkpoints.

Usage:
  onchange                 run the consumer (configuration from the environment below)
  onchange healthcheck     exit 0 when this onchange's /healthz answers [URL]
                           (the container health check)
  onchange version         the version, commit, commit time, dirty flag, Go version [--json]

Flags: --help, --help-all (the advanced variables too), --version. An unknown flag or command
exits 2; unknown SPIEGEL_* variables are warned about at start.`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	var cfg config.OnChange
	code, done := config.ConsumerFront("onchange", usage, os.Args[1:], &cfg, os.Stdout, os.Stderr)
	if !done {
		code = consumer.Main(ctx, "onchange", usage, os.Args[1:], os.Stdout, os.Stderr, &cfg,
			func(ctx context.Context, log *logrus.Logger) error {
				config.LogStart(log, "onchange", &cfg, os.Environ())
				return run(ctx, &cfg, log)
			})
	}
	stop()
	os.Exit(code)
}

// run connects, then runs the onchange jobs until ctx ends.
func run(ctx context.Context, cfg *config.OnChange, log logrus.FieldLogger) error {
	app, err := open(ctx, cfg, log.WithField("component", "onchange"))
	if err != nil {
		return err
	}
	return app.Run(ctx, cfg.HTTPAddr, newHandler(app.Deps, cfg).handle)
}

// open opens the consumer app with the onchange rule policy (SPIEGEL_PUBLISH_ALLOWED_SUBJECTS).
func open(ctx context.Context, cfg *config.OnChange, log logrus.FieldLogger) (*consumer.App, error) {
	return consumer.OpenWith(ctx, &cfg.Consumer, events.GroupOnChange, log,
		consumer.Options{Rules: rules.Policy{AllowedSubjects: cfg.AllowedSubjects}})
}
