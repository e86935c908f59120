package main

import (
	"context"
	"encoding/json"
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

// runResync enqueues a job for every db that a rule (and --db) matches.
func runResync(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	fs := flag.NewFlagSet("resync", flag.ContinueOnError)
	fs.SetOutput(cio.stderr)
	dbRE := fs.String("db", "", "only dbs matching this RE2 regex")
	if err := fs.Parse(cio.args); err != nil {
		return usageError{err}
	}
	re, err := dbFlagRegexp(*dbRE)
	if err != nil {
		return err
	}
	d, set, err := admin.Open(ctx, cfg, log, 1024)
	if err != nil {
		return err
	}
	defer func() { _ = d.NC.Drain() }()
	var pr progress
	return enqueueDBs(ctx, d, func(db string) []events.Group {
		if db == cfg.DBName || producer.IsSystemDB(db) || re != nil && !re.MatchString(db) {
			return nil
		}
		return set.Groups(db).Groups()
	}, events.ReasonResync, &pr, cio)
}

// runStatus reports rules, jobs and the producer's position, then the running processes and
// every rule's status (see admin.RuleStatus). It prints nothing secret.
func runStatus(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(cio.stderr)
	asJSON := fs.Bool("json", false, "print JSON")
	ruleID := fs.String("rule", "", "only this rule's status")
	if err := fs.Parse(cio.args); err != nil {
		return usageError{err}
	}
	d, set, err := admin.Open(ctx, cfg, discardLogger(), 16, events.Groups...)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	rep, err := admin.Status(ctx, d, set, *ruleID)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(cio.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
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
	if err := w.Flush(); err != nil {
		return err
	}
	printProcesses(cio.stdout, rep.Processes)
	printPerRule(cio.stdout, rep.PerRule, rep.Incomplete)
	return nil
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
