package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"regexp"
	"sort"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// openAdmin is the setup of the admin commands that act on an installation: it connects to
// CouchDB and NATS (maxPending publishes in flight), checks that install has run (the streams and
// the consumers of groups) and reads the rule set once. The caller closes d.NC.
func openAdmin(ctx context.Context, cfg *config.Producer, log *logrus.Logger, maxPending int, groups ...events.Group) (*producer.Conns, *rules.Set, error) {
	d, err := connectAdmin(ctx, cfg, log, maxPending)
	if err != nil {
		return nil, nil, err
	}
	if err := natsjs.CheckInstalled(ctx, d.JS, d.Topo, groups...); err != nil {
		d.NC.Close()
		return nil, nil, err
	}
	set := rules.NewSet()
	rf := &rulefeed.Follower{Couch: d.Couch, DB: d.Cfg.DBName, Set: set, Log: log.WithField("component", "rules")}
	if _, err := rf.Load(ctx); err != nil {
		d.NC.Close()
		return nil, nil, err
	}
	return d, set, nil
}

// progress prints "scanned N dbs, enqueued M jobs" to w at most every second and at the end.
type progress struct {
	scanned, enqueued, deduped atomic.Int64
	last                       time.Time
}

func (p *progress) print(c cmdIO, final bool) {
	if !final && time.Since(p.last) < time.Second {
		return
	}
	p.last = time.Now()
	fmt.Fprintf(c.stderr, "scanned %d dbs, enqueued %d jobs (%d were already pending)\n",
		p.scanned.Load(), p.enqueued.Load(), p.deduped.Load())
}

// enqueueDBs publishes a job per matching group for every db accepted by match, settling the
// publishes in windows of 256.
func enqueueDBs(ctx context.Context, d *producer.Conns, match func(db string) []events.Group, reason string, pr *progress, cio cmdIO) error {
	jobs := natsjs.NewJobs(d.JS, d.Topo.Subjects)
	type inflight struct {
		g events.Group
		j events.Job
		f jetstream.PubAckFuture
	}
	var window []inflight
	flush := func() error {
		for _, w := range window {
			var err error
			select {
			case <-w.f.Ok():
			case err = <-w.f.Err():
			case <-ctx.Done():
				return ctx.Err()
			}
			if err != nil {
				// A job pending or running (then with its wakeup marker), or one synchronous
				// retry for a failure.
				var dedup bool
				if natsjs.IsDuplicateJob(err) {
					dedup, err = jobs.MarkAndRetry(ctx, w.g, w.j)
				} else {
					dedup, err = jobs.Offer(ctx, w.g, w.j)
				}
				if err != nil {
					return err
				}
				if dedup {
					pr.deduped.Add(1)
					continue
				}
			}
			pr.enqueued.Add(1)
		}
		window = window[:0]
		return nil
	}
	err := d.Couch.EachDB(ctx, func(db string) error {
		pr.scanned.Add(1)
		for _, g := range match(db) {
			j := events.Job{DB: db, Reason: reason, At: time.Now().UTC()}
			f, err := jobs.PublishAsync(g, j)
			if err != nil {
				return err
			}
			window = append(window, inflight{g, j, f})
		}
		if len(window) >= 256 {
			if err := flush(); err != nil {
				return err
			}
			pr.print(cio, false)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := flush(); err != nil {
		return err
	}
	pr.print(cio, true)
	return nil
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
	d, set, err := openAdmin(ctx, cfg, log, 1024)
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

// statusReport is what `producer status` prints.
type statusReport struct {
	Rules struct {
		Replicators int               `json:"replicators"`
		OnChanges   int               `json:"on_changes"`
		Disabled    int               `json:"disabled"`
		Rejected    map[string]string `json:"rejected"`
	} `json:"rules"`
	Groups      map[string]groupStatus `json:"groups"`
	DeadLetters uint64                 `json:"dead_letters"`
	Position    *checkpoint.Position   `json:"producer_position,omitempty"`
	// Processes are the answers of the running producers and consumers (their NATS services).
	Processes []status.Report `json:"processes"`
	// PerRule is every rule's status (only --rule's with that flag), by id.
	PerRule []ruleStatus `json:"per_rule"`
	// Incomplete, when set, says what of PerRule could not be gathered within --timeout.
	Incomplete string `json:"per_rule_incomplete,omitempty"`
}

type groupStatus struct {
	Pending     uint64 `json:"pending"`
	InFlight    int    `json:"in_flight"`
	Redelivered int    `json:"redelivered"`
}

// runStatus reports rules, jobs and the producer's position, then the running processes and
// every rule's status (see ruleStatus). It prints nothing secret.
func runStatus(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(cio.stderr)
	asJSON := fs.Bool("json", false, "print JSON")
	ruleID := fs.String("rule", "", "only this rule's status")
	if err := fs.Parse(cio.args); err != nil {
		return usageError{err}
	}
	d, set, err := openAdmin(ctx, cfg, discardLogger(), 16, events.Groups...)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	var rep statusReport
	st := set.Stats()
	selected := set.All()
	if *ruleID != "" {
		r, ok := set.Rule(*ruleID)
		_, rejected := st.RejectedIDs[*ruleID]
		if !ok && !rejected {
			return fmt.Errorf("status: no rule %q in %s", *ruleID, cfg.DBName)
		}
		selected = nil
		if ok {
			selected = []rules.Rule{r}
		}
	}
	timeout := cfg.AdminTimeout
	if timeout <= 0 {
		timeout = defaultAdminTimeout
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var collectErr error
	var wg sync.WaitGroup
	wg.Go(func() {
		rep.Processes, collectErr = status.Collect(wctx, d.NC, cfg.SubjectPrefix, min(timeout, collectWait))
	})
	checker, err := openRuleChecker(wctx, d, cfg.DBName)
	if err != nil {
		return err
	}
	rep.PerRule, rep.Incomplete = checker.perRule(wctx, selected)
	wg.Wait()
	if collectErr != nil {
		return collectErr
	}
	withProcesses(rep.PerRule, rep.Processes)
	if rep.Processes == nil {
		rep.Processes = []status.Report{}
	}
	rep.Rules.Replicators, rep.Rules.OnChanges, rep.Rules.Disabled = st.Replicators, st.OnChanges, st.Disabled
	rep.Rules.Rejected = st.RejectedIDs
	rep.Groups = map[string]groupStatus{}
	for _, g := range events.Groups {
		c, err := d.JS.Consumer(ctx, d.Topo.Subjects.WorkStream(), g.ConsumerName())
		if err != nil {
			return fmt.Errorf("read consumer %s: %w", g.ConsumerName(), err)
		}
		info, err := c.Info(ctx)
		if err != nil {
			return fmt.Errorf("read consumer %s: %w", g.ConsumerName(), err)
		}
		rep.Groups[string(g)] = groupStatus{Pending: info.NumPending, InFlight: info.NumAckPending, Redelivered: info.NumRedelivered}
	}
	if s, err := d.JS.Stream(ctx, d.Topo.Subjects.DeadLetterStream()); err == nil {
		rep.DeadLetters = s.CachedInfo().State.Msgs
	}
	if pos, err := checkpoint.NewStore(d.Couch, cfg.DBName).Position(ctx); err == nil {
		rep.Position = &pos
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
