package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"regexp"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/producer"
)

// progress prints "scanned N dbs, enqueued M jobs" to w at most every second and at the end.
type progress struct {
	admin.Progress
	last time.Time
}

func (p *progress) print(c cmdIO, final bool) {
	if !final && time.Since(p.last) < time.Second {
		return
	}
	p.last = time.Now()
	fmt.Fprintf(c.stderr, "scanned %d dbs, enqueued %d jobs (%d were already pending)\n",
		p.Scanned.Load(), p.Enqueued.Load(), p.Deduped.Load())
}

// enqueueDBs is admin.EnqueueDBs with the progress printed on cio.
func enqueueDBs(ctx context.Context, d *producer.Conns, match func(db string) []events.Group, reason string, pr *progress, cio cmdIO) error {
	return admin.EnqueueDBs(ctx, d, match, reason, &pr.Progress, func(final bool) { pr.print(cio, final) })
}

const resyncHelp = `Enqueue a job for every db that a rule matches (and REGEX, an RE2 regex, when given), with a
progress display on stderr. Jobs already pending are deduplicated. --json: the counts at the end,
{"scanned", "enqueued", "already_pending"}.`

const statusHelp = `Rules loaded and rejected (with reasons), pending and in-flight jobs per group, dead letters,
and the producer's saved position; CouchDB's [global_changes] max_write_delay and max_event_delay
(read on every node, never changed: the floor of the _db_updates feed's latency, with a hint while
either is CouchDB's default, 500 and 25 ms; CouchDB applies max_event_delay only when the node
starts; unknown, with the reason, on PouchDB Server or without a server admin; not part of
--check); then the running producers and consumers (the answers of their NATS
services); then every rule (or only ID): kind, pattern, engine, enabled, dbs matched,
for on_change rules the dbs behind their checkpoint and the oldest unprocessed change's age, and
the consumers' last run, result, failures in the last hour and dead letters.
--check: print one line and exit with a code, for scripts and probes:
  0  healthy
  1  the status could not be gathered (CouchDB or NATS not reachable, not installed)
  2  a bad command line
  3  unhealthy: no producer answers or its feed is not running, a process reports an error in
     the last hour, a rule is rejected, or a gap in a rule's output or a loss of the changes
     stream is reported; the line names each reason`

type resyncOpts struct {
	db   *regexp.Regexp
	json bool
}

func resyncFlags(fs *flag.FlagSet) (*string, *bool) {
	return fs.String("db", "", "only dbs matching this `REGEX` (RE2)"), fs.Bool("json", false, "print the counts as JSON")
}

func parseResync(args []string) (*resyncOpts, error) {
	fs := flag.NewFlagSet("resync", flag.ContinueOnError)
	dbRE, asJSON := resyncFlags(fs)
	if err := parseFlags(fs, args, false); err != nil {
		return nil, err
	}
	re, err := dbFlagRegexp(*dbRE)
	return &resyncOpts{db: re, json: *asJSON}, err
}

// runResync enqueues a job for every db that a rule (and --db) matches.
func runResync(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	o, err := parseResync(cio.args)
	if err != nil {
		return err
	}
	d, set, err := admin.Open(ctx, cfg, log, 1024)
	if err != nil {
		return err
	}
	defer func() { _ = d.NC.Drain() }()
	var pr progress
	err = enqueueDBs(ctx, d, func(db string) []events.Group {
		if db == cfg.DBName || producer.IsSystemDB(db) || o.db != nil && !o.db.MatchString(db) {
			return nil
		}
		return set.Groups(db).Groups()
	}, events.ReasonResync, &pr, cio)
	if err != nil || !o.json {
		return err
	}
	return printJSON(cio.stdout, map[string]int64{"scanned": pr.Scanned.Load(), "enqueued": pr.Enqueued.Load(),
		"already_pending": pr.Deduped.Load()})
}

type statusOpts struct {
	json, check bool
	rule        string
}

func statusFlags(fs *flag.FlagSet) *statusOpts {
	o := &statusOpts{}
	fs.BoolVar(&o.json, "json", false, "print JSON")
	fs.StringVar(&o.rule, "rule", "", "only this rule's status (`ID`)")
	fs.BoolVar(&o.check, "check", false, "print one line and exit 0 when healthy, 3 when not (see above)")
	return o
}

func parseStatus(args []string) (*statusOpts, error) {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	o := statusFlags(fs)
	return o, parseFlags(fs, args, false)
}

// runStatus reports rules, jobs and the producer's position, then the running processes and
// every rule's status (see admin.RuleStatus). It prints nothing secret. With --check it prints
// one line and returns an unhealthyError when the installation is not healthy (checkHealth).
func runStatus(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	o, err := parseStatus(cio.args)
	if err != nil {
		return err
	}
	d, set, err := admin.Open(ctx, cfg, discardLogger(), 16, events.Groups...)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	rep, err := admin.Status(ctx, d, set, o.rule)
	if err != nil {
		return err
	}
	if o.check {
		return reportHealth(cio.stdout, rep, o.json, time.Now())
	}
	// CouchDB's [global_changes] delays, the floor of the feed's latency: read, never changed;
	// unknown (with the reason) where they cannot be read. --check does not look at them.
	gcCtx, cancel := context.WithTimeout(ctx, cmp.Or(cfg.AdminTimeout, 15*time.Second))
	gc := readGlobalChanges(gcCtx, d.Couch)
	cancel()
	if o.json {
		return printJSON(cio.stdout, statusOutput{StatusReport: rep, GlobalChanges: gc})
	}
	w := tabwriter.NewWriter(cio.stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintf(w, "rules\treplicator %d, on_change %d, disabled %d, rejected %d\n",
		rep.Rules.Replicators, rep.Rules.OnChanges, rep.Rules.Disabled, len(rep.Rules.Rejected))
	ids := make([]string, 0, len(rep.Rules.Rejected))
	for id := range rep.Rules.Rejected {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		fmt.Fprintf(w, "  rejected\t%s\n", rep.Rules.Rejected[id])
	}
	for _, g := range events.Groups {
		gs := rep.Groups[string(g)]
		fmt.Fprintf(w, "jobs %s\tpending %d, in flight %d, redelivered %d\n", g, gs.Pending, gs.InFlight, gs.Redelivered)
	}
	fmt.Fprintf(w, "dead letters\t%d\n", rep.DeadLetters)
	if rep.Position != nil {
		fmt.Fprintf(w, "producer position\t%s (source %s, saved %s ago)\n", rep.Position.LastSeq, rep.Position.Source,
			time.Since(rep.Position.UpdatedAt).Round(time.Second))
	} else {
		fmt.Fprintln(w, "producer position\tnone saved yet")
	}
	printGlobalChanges(w, gc)
	if err := w.Flush(); err != nil {
		return err
	}
	printProcesses(cio.stdout, rep.Processes)
	printPerRule(cio.stdout, rep.PerRule, rep.Incomplete)
	return nil
}

// statusOutput is what `producer status --json` prints: the report and CouchDB's
// [global_changes] delays.
type statusOutput struct {
	*admin.StatusReport
	GlobalChanges *globalChanges `json:"couchdb_global_changes"`
}

func discardLogger() *logrus.Logger {
	l := logrus.New()
	l.SetLevel(logrus.PanicLevel)
	return l
}

// dbFlagRegexp compiles the --db flag (nil when empty); a bad regex is a usage error.
func dbFlagRegexp(expr string) (*regexp.Regexp, error) {
	if expr == "" {
		return nil, nil
	}
	re, err := regexp.Compile(expr)
	if err != nil {
		return nil, usageError{fmt.Errorf("--db %q: %w", expr, err)}
	}
	return re, nil
}
