// Command producer tails CouchDB's db updates and publishes one deduplicated job per (group, db)
// to the JetStream work queue. Its subcommands install, uninstall, resync, replay and report the
// status of a Spiegel installation.
package main

import (
	"context"
	"errors"
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
  producer                 run the producer (tail db updates, publish jobs)
  producer install         create the spiegel db, its validation, _global_changes, streams and consumers
                           that are missing; print how existing ones differ [--update: apply that]
  producer uninstall       remove streams and consumers (and the spiegel db unless --keep-db); asks first unless --yes
  producer resync          enqueue a job for every db a rule matches [--db REGEX]
  producer replay          dispatch an on_change rule's history again: --rule ID [--db REGEX] [--since SEQ] [--id ID] [--wait D]
  producer deadletters     list, retry or purge dead letters: list|retry|purge [--group G] [--rule ID] [--db REGEX] [--since AGE]
  producer status          rules, jobs, position, running processes, per-rule state [--rule ID] [--json]
  producer rules           rules as code: list | get ID | apply FILE... [--dry-run] | delete ID | validate FILE... [--json]
  producer healthcheck     exit 0 when this producer's /healthz answers (the container health check) [URL]

Every command accepts --help and --version. The admin commands wait at most --timeout (default
15s, SPIEGEL_ADMIN_TIMEOUT) for CouchDB and NATS, then exit 1 naming each problem.`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := realMain(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// realMain runs one command and returns the process exit code.
func realMain(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	cmd := ""
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		cmd, args = args[0], args[1:]
	}
	var cfg config.Producer
	if cmd == "healthcheck" {
		return health.ProbeCommand(ctx, "producer", args, config.HTTPAddr(&cfg), stdout, stderr)
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
	for _, a := range args {
		switch a {
		case "--help", "-h", "-help":
			printHelp(stdout, cmd, &cfg)
			return 0
		case "--version", "-version":
			fmt.Fprintln(stdout, "producer", config.Version)
			return 0
		}
	}
	run, ok := commands[cmd]
	if !ok {
		fmt.Fprintf(stderr, "producer: unknown command %q\n\n%s\n", cmd, usage)
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
	err = run(ctx, &cfg, log, cmdIO{args: args, stdin: stdin, stdout: stdout, stderr: stderr})
	if err == nil {
		return 0
	}
	var uerr usageError
	if errors.As(err, &uerr) {
		fmt.Fprintf(stderr, "producer %s: %v\n", cmd, err)
		return 2
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
			return usageError{fmt.Errorf("unexpected arguments %q", io.args)}
		}
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

var commandHelp = map[string]string{
	"install": `producer install [--update] — create what Spiegel needs and is missing (idempotent; safe to run
  twice or concurrently): the spiegel db with admin-only security and a validate_doc_update that
  rejects invalid rule docs, _global_changes on CouchDB 2/3 when missing, the JetStream streams
  (work, wakeups, dead letters, changes), the key-value buckets and the durable consumers
  "replicator" and "onchange". What exists is left as it is: install prints each setting in which
  an existing stream, bucket or consumer differs from what it would create (e.g. a max_age set
  with nats stream edit), and keeps it.
  --update  apply those differences (UpdateStream, UpdateConsumer) and print each one changed;
            what JetStream cannot change in place (storage, a work queue's retention, a
            consumer's ack or deliver policy) is reported and kept.
  SPIEGEL_CHANGES_MAX_AGE, SPIEGEL_DEADLETTER_MAX_AGE and SPIEGEL_MAX_ACK_PENDING set what it creates.`,
	"uninstall": `producer uninstall [--yes] [--keep-db] — delete the streams and consumers and the spiegel db
  (rules and checkpoints). Asks for confirmation on the terminal unless --yes. --keep-db keeps the
  spiegel db and its rules.`,
	"resync": `producer resync [--db REGEX] — enqueue a job for every db that a rule matches (and REGEX, an
  RE2 regex, when given), with a progress display. Jobs already pending are deduplicated.`,
	"replay": `producer replay --rule ID [--db REGEX] [--since SEQ] [--id ID] [--wait DURATION] — reset the
  checkpoints of the on_change rule ID (in the dbs it matches, optionally only those matching REGEX)
  to the beginning or to SEQ, and enqueue those dbs, so the rule's history is dispatched again. A
  subject rule publishes it again under the replay's id (printed; --id to resume or repeat a replay
  without storing any change twice): message id replay/<id>/<db>/<doc id>/<rev>, header
  Spiegel-Replay: <id>. The command then waits (--wait, default 10m; 0: no wait) until every db's
  replay reached the end of its feed and prints per db how many changes it re-dispatched; it exits
  1 when a db is not done in time.`,
	"deadletters": `producer deadletters list|retry|purge [--group G] [--rule ID] [--db REGEX] [--since AGE]
      [--before ID] [--limit N] [--json] [--yes]
  list: the dead-letter records that match, newest first (50 unless --limit; --before ID shows the
    next page): id, time, group, rule, db, seq, doc id, status, attempts, error.
  retry: re-drive them, then delete them. An on_change record resumes its rule in its db from just
    before the failed change (the checkpoint moves back only if it is past that point; later
    changes are dispatched again too); a replicator record enqueues its db. Records whose rule
    or db is gone are kept, with the reason. Asks for confirmation unless --yes.
  purge: delete them. Asks for confirmation unless --yes.
  --group is replicate or onchange; --db an RE2 regex; --since an age such as 90m, 24h or 7d.`,
	"status": `producer status [--rule ID] [--json] — rules loaded and rejected (with reasons), pending and
  in-flight jobs per group, dead letters, and the producer's saved position; then the running
  producers and consumers (the answers of their NATS services); then every rule (or only ID):
  kind, pattern, engine, enabled, dbs matched, for on_change rules the dbs behind their checkpoint
  and the oldest unprocessed change's age, and the consumers' last run, result, failures in the
  last hour and dead letters.`,
}

func printHelp(w io.Writer, cmd string, cfg *config.Producer) {
	text := usage
	if h, ok := commandHelp[cmd]; ok {
		text = h
	}
	config.PrintHelp(w, text, cfg)
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
