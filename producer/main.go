// Command producer tails CouchDB's db updates and publishes one deduplicated job per (group, db)
// to the JetStream work queue. Its subcommands install, uninstall, resync, replay and report the
// status of a Spiegel installation.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
)

const usage = `producer — Spiegel for NATS: CouchDB db updates → deduplicated JetStream jobs

Usage:
  producer               run the producer (tail db updates, publish jobs)
  producer install       create the spiegel db, its validation, _global_changes, streams and
                         consumers that are missing; print how existing ones differ [--update]
  producer uninstall     remove streams and consumers (and the spiegel db unless --keep-db)
  producer resync        enqueue a job for every db a rule matches [--db REGEX]
  producer replay        dispatch an on_change rule's history again: --rule ID [--db REGEX]
                         [--since SEQ] [--id ID] [--wait D]
  producer deadletters   list, retry or purge dead letters: list|retry|purge [filters]
  producer status        rules, jobs, position, processes, per-rule state [--rule ID] [--check]
  producer rules         rules as code: list | get ID | apply FILE... | delete ID | validate FILE...
  producer healthcheck   exit 0 when this producer's /healthz answers (the container health check)
  producer version       the version, commit, commit time, dirty flag and Go version [--json]
  producer help COMMAND  the help of a command: its flags and the variables it reads

Every command accepts --help (--help-all: with the advanced variables) and --version; the admin
commands that report something accept --json. They wait at most --timeout (default 15s,
SPIEGEL_ADMIN_TIMEOUT) for CouchDB and NATS, then exit 1 naming each problem. An unknown flag or
command exits 2; unknown SPIEGEL_* variables are warned about.`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := realMain(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// realMain runs one command and returns the process exit code: 0 done, 1 failed, 2 a bad
// command line or configuration, exitUnhealthy for `status --check` on an unhealthy installation.
func realMain(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	cmd := ""
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		cmd, args = args[0], args[1:]
	}
	var cfg config.Producer
	switch cmd {
	case "healthcheck":
		return health.ProbeCommand(ctx, "producer", args, config.HTTPAddr(&cfg), stdout, stderr)
	case "help":
		return helpCommand(args, stdout, stderr)
	case "version":
		return versionCommand(args, stdout, stderr)
	}
	run, ok := commands[cmd]
	if !ok {
		fmt.Fprintf(stderr, "producer: %s (see producer --help)\n", config.UnknownArg(cmd))
		return 2
	}
	if code, done := helpOrVersion(cmd, args, stdout); done {
		return code
	}
	var timeout time.Duration
	var err error
	if cmd != "" {
		args, timeout, err = timeoutFlag(args)
	}
	if err != nil {
		fmt.Fprintf(stderr, "producer %s: %v\n", cmd, err)
		return 2
	}
	if cmd == "rules" { // its subcommands' help, and validate, which needs no configuration
		if code, done := rulesWithoutConfig(ctx, args, stdout, stderr); done {
			return code
		}
	}
	if err := checkArgs(cmd, args); err != nil {
		fmt.Fprintf(stderr, "%s: %v (see %s --help)\n", strings.TrimSpace("producer "+cmd), err, strings.TrimSpace("producer "+cmd))
		return 2
	}
	if err := config.Load(&cfg); err != nil {
		fmt.Fprintf(stderr, "producer: %v\n(run `producer --help` for every variable)\n", err)
		return 2
	}
	if timeout > 0 {
		cfg.AdminTimeout = timeout
	}
	if _, set := os.LookupEnv("SPIEGEL_LOG_FORMAT"); cmd != "" && !set && isTerminal(stderr) {
		cfg.LogFormat = "text" // an admin command at a terminal speaks to a person
	}
	log, err := logging.New(cfg.LogLevel, cfg.LogFormat, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "producer: %v\n", err)
		return 2
	}
	if cmd != "" { // the producer itself logs them in its start-up line
		config.WarnEnv(log, "producer", &cfg, os.Environ())
	}
	err = run(ctx, &cfg, log, cmdIO{args: args, stdin: stdin, stdout: stdout, stderr: stderr})
	return exitCode(cmd, err, log, stderr)
}

// exitCode prints what the person who ran cmd must know of err and returns the exit code.
func exitCode(cmd string, err error, log *logrus.Logger, stderr io.Writer) int {
	if err == nil {
		return 0
	}
	var uerr usageError
	if errors.As(err, &uerr) {
		fmt.Fprintf(stderr, "producer %s: %v\n", cmd, err)
		return 2
	}
	var unhealthy unhealthyError
	if errors.As(err, &unhealthy) {
		return exitUnhealthy // status --check printed the reasons
	}
	msg := logging.RedactText(err.Error())
	if errors.Is(err, natsjs.ErrNotInstalled) {
		fmt.Fprintf(stderr, "producer: %s\nRun `producer install` to create the spiegel db, streams and consumers.\n", msg)
		return 1
	}
	if cmd == "" {
		log.WithField("component", "producer").Error(msg)
		return 1
	}
	// An admin command's failure is for the person who ran it: one plain line per problem.
	var problems admin.ServerProblems
	if errors.As(err, &problems) {
		for _, p := range problems {
			fmt.Fprintf(stderr, "producer %s: %s\n", cmd, logging.RedactText(p))
		}
		return 1
	}
	if errors.Is(err, context.Canceled) {
		msg = "interrupted"
	}
	fmt.Fprintf(stderr, "producer %s: %s\n", cmd, msg)
	return 1
}

// helpOrVersion answers --help, --help-all and --version anywhere among the arguments of cmd
// (rules answers its subcommands' help itself).
func helpOrVersion(cmd string, args []string, stdout io.Writer) (code int, done bool) {
	for _, a := range args {
		switch {
		case config.IsHelpAll(a):
			printHelp(stdout, cmd, true)
			return 0, true
		case config.IsHelp(a) && cmd != "rules":
			printHelp(stdout, cmd, false)
			return 0, true
		case config.IsVersion(a):
			config.PrintVersion(stdout, "producer", false)
			return 0, true
		}
	}
	return 0, false
}

// helpCommand is `producer help [COMMAND]`.
func helpCommand(args []string, stdout, stderr io.Writer) int {
	switch {
	case len(args) == 0:
		printHelp(stdout, "", false)
		return 0
	case len(args) > 1:
		fmt.Fprintf(stderr, "producer help: want one command, got %q\n", args)
		return 2
	case args[0] == "rules":
		printRulesHelp(stdout, "")
		return 0
	}
	if _, ok := cliCommands[args[0]]; !ok {
		fmt.Fprintf(stderr, "producer help: %s (see producer --help)\n", config.UnknownArg(args[0]))
		return 2
	}
	printHelp(stdout, args[0], false)
	return 0
}

// versionCommand is `producer version [--json]`.
func versionCommand(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parseFlags(fs, args, false); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stdout, "producer version [--json] — the version, commit, commit time, dirty flag and Go version")
			return 0
		}
		fmt.Fprintf(stderr, "producer version: %v\n", err)
		return 2
	}
	config.PrintVersion(stdout, "producer", *asJSON)
	return 0
}

// timeoutFlag takes the admin commands' --timeout DURATION (or --timeout=DURATION) out of args.
func timeoutFlag(args []string) (rest []string, timeout time.Duration, err error) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || name != "timeout" {
			rest = append(rest, a)
			continue
		}
		if !hasValue {
			if i+1 >= len(args) {
				return nil, 0, errors.New("--timeout needs a duration, e.g. --timeout 30s")
			}
			i++
			value = args[i]
		}
		timeout, err = time.ParseDuration(value)
		if err != nil || timeout <= 0 {
			return nil, 0, fmt.Errorf("--timeout %q: want a positive duration, e.g. 30s", value)
		}
	}
	return rest, timeout, nil
}

// cmdIO is what a command reads and writes besides its configuration.
type cmdIO struct {
	args           []string
	stdin          io.Reader
	stdout, stderr io.Writer
}

type command func(ctx context.Context, cfg *config.Producer, log *logrus.Logger, io cmdIO) error

var commands = map[string]command{
	"": func(ctx context.Context, cfg *config.Producer, log *logrus.Logger, io cmdIO) error {
		if len(io.args) > 0 {
			return usageError{errors.New(config.UnknownArg(io.args[0]))}
		}
		config.LogStart(log, "producer", cfg, os.Environ())
		return producer.Run(ctx, cfg, log)
	},
	"install":   runInstall,
	"uninstall": runUninstall,
	"resync":    runResync,
	"replay":    runReplay,
	"status":    runStatus,
	"rules":     runRules,

	"deadletters": runDeadLetters,
}

// usageError marks a bad command line (exit code 2).
type usageError struct{ error }

// printHelp prints the help of cmd: the producer's usage and variables ("" or an unknown cmd),
// rules' own, or an admin command's flags and variables; all adds the advanced variables.
func printHelp(w io.Writer, cmd string, all bool) {
	if cmd == "rules" {
		printRulesHelp(w, "")
		return
	}
	if c, ok := cliCommands[cmd]; ok {
		printCommandHelp(w, cmd, c, all)
		return
	}
	if all {
		config.PrintHelpAll(w, usage, &config.Producer{})
		return
	}
	config.PrintHelp(w, usage, &config.Producer{})
}

// isTerminal reports whether w is a terminal: admin commands then speak text, not JSON.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
