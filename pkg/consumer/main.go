package consumer

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

// Spec is a consumer binary's configuration struct.
type Spec interface {
	Validate() error
	LogSettings() config.Log
}

// Main is the whole main function of a consumer binary: --help and --version, the healthcheck
// command, configuration, logging, then run. It returns the exit code: 0 on a clean stop, 1 on a
// runtime error, 2 on bad configuration or arguments.
func Main(ctx context.Context, name, usage string, args []string, stdout, stderr io.Writer, spec Spec,
	run func(ctx context.Context, log *logrus.Logger) error) int {
	if len(args) > 0 && args[0] == "healthcheck" {
		return health.ProbeCommand(ctx, name, args[1:], config.HTTPAddr(spec), stdout, stderr)
	}
	for _, a := range args {
		switch a {
		case "--help", "-h", "-help":
			config.PrintHelp(stdout, usage, spec)
			return 0
		case "--version", "-version":
			fmt.Fprintln(stdout, name, config.Version)
			return 0
		default:
			fmt.Fprintf(stderr, "%s: unexpected argument %q (try --help)\n", name, a)
			return 2
		}
	}
	if err := config.Load(spec); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n(run `%s --help` for every variable)\n", name, err, name)
		return 2
	}
	ls := spec.LogSettings()
	log, err := logging.New(ls.LogLevel, ls.LogFormat, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	err = run(ctx, log)
	if err == nil || errors.Is(err, context.Canceled) {
		return 0
	}
	msg := logging.RedactText(err.Error())
	if errors.Is(err, natsjs.ErrNotInstalled) {
		fmt.Fprintf(stderr, "%s: %s\nRun `producer install` to create the spiegel db, streams and consumers.\n", name, msg)
		return 1
	}
	log.WithField("component", name).Error(msg)
	return 1
}
