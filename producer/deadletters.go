package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// deadLetter is a dead-letter record with its id: its sequence in the dead-letter stream.
type deadLetter struct {
	ID uint64 `json:"id"`
	worker.DeadLetter
}

// dlFilter selects dead-letter records.
type dlFilter struct {
	group  events.Group
	rule   string
	db     *regexp.Regexp
	since  time.Duration // only records at most this old (0: all)
	before uint64        // only records with a smaller id (0: all): the next page
	limit  int           // at most this many, newest first (0: all)
}

func (f dlFilter) match(r deadLetter) bool {
	return (f.group == "" || r.Group == f.group) && (f.rule == "" || r.Rule == f.rule) &&
		(f.db == nil || f.db.MatchString(r.DB)) && (f.before == 0 || r.ID < f.before)
}

// runDeadLetters is `producer deadletters list|retry|purge [filters]`.
func runDeadLetters(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	if len(cio.args) == 0 || strings.HasPrefix(cio.args[0], "-") {
		return usageError{errors.New("want a subcommand: list, retry or purge")}
	}
	sub, args := cio.args[0], cio.args[1:]
	if sub != "list" && sub != "retry" && sub != "purge" {
		return usageError{fmt.Errorf("unknown subcommand %q: want list, retry or purge", sub)}
	}
	fs := flag.NewFlagSet("deadletters "+sub, flag.ContinueOnError)
	fs.SetOutput(cio.stderr)
	group := fs.String("group", "", "only records of this group: replicate or onchange")
	rule := fs.String("rule", "", "only records of this rule id")
	dbRE := fs.String("db", "", "only records of dbs matching this RE2 regex")
	since := fs.String("since", "", "only records at most this old (e.g. 90m, 24h, 7d)")
	before := fs.Uint64("before", 0, "only records with a smaller id (the next page of list)")
	limit := fs.Int("limit", map[string]int{"list": 50}[sub], "at most this many records, newest first (0: all)")
	asJSON := fs.Bool("json", false, "print JSON")
	yes := fs.Bool("yes", false, "do not ask for confirmation")
	if err := fs.Parse(args); err != nil {
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected arguments %q", fs.Args())}
	}
	f := dlFilter{group: events.Group(*group), rule: *rule, before: *before, limit: *limit}
	if f.group != "" && !slices.Contains(events.Groups, f.group) {
		return usageError{fmt.Errorf("--group %q: unknown group, want replicate or onchange", *group)}
	}
	if f.limit < 0 {
		return usageError{fmt.Errorf("--limit %d: want 0 (all) or more", f.limit)}
	}
	var err error
	if f.db, err = dbFlagRegexp(*dbRE); err != nil {
		return err
	}
	if f.since, err = parseAge(*since); err != nil {
		return usageError{fmt.Errorf("--since %q: %w", *since, err)}
	}
	d, set, err := openAdmin(ctx, cfg, discardLogger(), 16, events.Groups...)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	stream, err := d.JS.Stream(ctx, d.Topo.Subjects.DeadLetterStream())
	if err != nil {
		return fmt.Errorf("open the dead-letter stream %s: %w", d.Topo.Subjects.DeadLetterStream(), err)
	}
	if sub == "list" {
		return listDeadLetters(ctx, cio, stream, d.Topo.Subjects, f, *asJSON)
	}
	var recs []deadLetter
	if err := eachDeadLetter(ctx, stream, d.Topo.Subjects, f, func(r deadLetter) bool {
		recs = append(recs, r)
		return f.limit == 0 || len(recs) < f.limit
	}); err != nil {
		return err
	}
	if len(recs) == 0 {
		return errors.New("no dead letter matches the filters: nothing to " + sub)
	}
	if sub == "purge" {
		if !*yes && !confirm(cio, fmt.Sprintf("This deletes %d dead letters.", len(recs))) {
			return usageError{errors.New("not confirmed; nothing was deleted (use --yes to skip the question)")}
		}
		for _, r := range recs {
			if err := deleteRecord(ctx, stream, r.ID); err != nil {
				return err
			}
		}
		fmt.Fprintf(cio.stdout, "deleted %d dead letters\n", len(recs))
		return nil
	}
	kv, err := natsjs.OnChangeBucket(ctx, d.JS, d.Topo)
	if err != nil {
		return err
	}
	rd := &redriver{couch: d.Couch, store: checkpoint.NewOnChangeStore(d.Couch, kv), jobs: natsjs.NewJobs(d.JS, d.Topo.Subjects), stream: stream}
	plans := planRedrives(recs, set)
	if !*yes && !confirm(cio, describePlans(plans)) {
		return usageError{errors.New("not confirmed; nothing was re-driven (use --yes to skip the question)")}
	}
	return rd.run(ctx, plans, cio.stdout)
}

// parseAge parses a duration, accepting whole days ("7d") as well.
func parseAge(s string) (time.Duration, error) {
	if s == "" {
		return 0, nil
	}
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n <= 0 {
			return 0, errors.New("want a positive duration, e.g. 90m, 24h or 7d")
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	age, err := time.ParseDuration(s)
	if err != nil || age <= 0 {
		return 0, errors.New("want a positive duration, e.g. 90m, 24h or 7d")
	}
	return age, nil
}

// dlSpan is how many stream sequences one read of eachDeadLetter covers: what it holds in memory
// at most, whatever the size of the stream.
const dlSpan = 1000

// eachDeadLetter calls fn with each record f selects (f.limit aside), newest first, until fn
// returns false. It reads the stream backwards, one span of dlSpan sequences at a time through a
// short-lived consumer (filtered on the group's subjects), so that memory holds one span, and a
// full page or a record older than f.since ends the reading early.
func eachDeadLetter(ctx context.Context, stream jetstream.Stream, subjects events.Subjects, f dlFilter, fn func(deadLetter) bool) error {
	info, err := stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("read dead letters: %w", err)
	}
	st := info.State
	if st.Msgs == 0 {
		return nil
	}
	end := st.LastSeq + 1
	if f.before > 0 && f.before < end {
		end = f.before
	}
	var oldest time.Time
	if f.since > 0 {
		oldest = time.Now().Add(-f.since)
	}
	filter := subjects.DeadLetterAll()
	if f.group != "" {
		filter = strings.TrimSuffix(subjects.DeadLetterAll(), ">") + string(f.group) + ".>"
	}
	for end > st.FirstSeq {
		start := st.FirstSeq
		if end-st.FirstSeq > dlSpan {
			start = end - dlSpan
		}
		recs, older, err := readSpan(ctx, stream, filter, start, end, oldest)
		if err != nil {
			return err
		}
		for _, r := range slices.Backward(recs) {
			if f.match(r) && !fn(r) {
				return nil
			}
		}
		if older {
			return nil
		}
		end = start
	}
	return nil
}

// readSpan reads the records on filter with sequences in [start, end), oldest first, leaving out
// those older than oldest (older then reports that there were some).
func readSpan(ctx context.Context, stream jetstream.Stream, filter string, start, end uint64, oldest time.Time) (recs []deadLetter, older bool, err error) {
	c, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		FilterSubject: filter, AckPolicy: jetstream.AckNonePolicy, InactiveThreshold: time.Minute, MemoryStorage: true,
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: start,
	})
	if err != nil {
		return nil, false, fmt.Errorf("read dead letters: %w", err)
	}
	defer func() { _ = stream.DeleteConsumer(context.WithoutCancel(ctx), c.CachedInfo().Name) }()
	left := c.CachedInfo().NumPending // from start to the end of the stream
	for left > 0 {
		batch, err := c.Fetch(int(min(left, dlSpan)), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return nil, false, fmt.Errorf("read dead letters: %w", err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			meta, err := m.Metadata()
			if err != nil {
				return nil, false, fmt.Errorf("read dead letters: %w", err)
			}
			if meta.Sequence.Stream >= end {
				left = 0
				continue
			}
			if meta.Timestamp.Before(oldest) {
				older = true
				continue
			}
			r := deadLetter{ID: meta.Sequence.Stream}
			if err := json.Unmarshal(m.Data(), &r.DeadLetter); err != nil {
				r.Error = fmt.Sprintf("unreadable record on %s: %v", m.Subject(), err)
			}
			recs = append(recs, r)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, false, fmt.Errorf("read dead letters: %w", err)
		}
		if n == 0 {
			return nil, false, fmt.Errorf("read dead letters: %d records announced but none came", left)
		}
		left -= min(uint64(n), left)
	}
	return recs, older, nil
}

// listDeadLetters prints the records f selects, newest first, as a table (or JSON) while it
// reads them, at most f.limit (0: all), and says how to see the next page. What it holds in
// memory is bounded by a span and a block of rows, whatever the number of records.
func listDeadLetters(ctx context.Context, cio cmdIO, stream jetstream.Stream, subjects events.Subjects, f dlFilter, asJSON bool) error {
	var (
		n, block int
		last     uint64
		more     bool
		werr     error
	)
	tw := tabwriter.NewWriter(cio.stdout, 0, 4, 2, ' ', 0)
	if asJSON {
		_, werr = io.WriteString(cio.stdout, "[")
	}
	err := eachDeadLetter(ctx, stream, subjects, f, func(r deadLetter) bool {
		if f.limit > 0 && n == f.limit {
			more = true
			return false
		}
		if asJSON {
			sep := ",\n  "
			if n == 0 {
				sep = "\n  "
			}
			b, _ := json.Marshal(r)
			if _, err := io.WriteString(cio.stdout, sep+string(b)); err != nil {
				werr = err
				return false
			}
		} else {
			if n == 0 {
				fmt.Fprintln(tw, "ID\tTIME (UTC)\tGROUP\tRULE\tDB\tSEQ\tDOC\tSTATUS\tATTEMPTS\tERROR")
			}
			printDeadLetter(tw, r)
			// Rows are aligned within blocks, so that memory holds one block.
			if block++; block == dlSpan {
				block = 0
				if err := tw.Flush(); err != nil {
					werr = err
					return false
				}
			}
		}
		n++
		last = r.ID
		return true
	})
	if err != nil {
		return err
	}
	if werr != nil {
		return werr
	}
	if asJSON {
		end := "]\n"
		if n > 0 {
			end = "\n]\n"
		}
		_, err := io.WriteString(cio.stdout, end)
		return err
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch {
	case n == 0:
		fmt.Fprintln(cio.stderr, "no dead letter matches the filters")
	case more:
		fmt.Fprintf(cio.stderr, "%d records (newest first); next page: --before %d, all: --limit 0\n", n, last)
	}
	return nil
}

// printDeadLetter prints one row of the table.
func printDeadLetter(w io.Writer, r deadLetter) {
	status := "-"
	if r.Status != 0 {
		status = strconv.Itoa(r.Status)
	}
	fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", r.ID, r.At.UTC().Format("2006-01-02 15:04:05"),
		r.Group, dash(r.Rule), r.DB, dash(shorten(r.Seq, 16)), dash(shorten(r.DocID, 24)), status, r.Attempts, shorten(r.Error, 72))
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func shorten(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

// confirm asks the person at cio's terminal to type "yes" after question.
func confirm(cio cmdIO, question string) bool {
	fmt.Fprintf(cio.stderr, "%s\nType \"yes\" to continue: ", question)
	answer, _ := bufio.NewReader(cio.stdin).ReadString('\n')
	return strings.TrimSpace(answer) == "yes"
}

func deleteRecord(ctx context.Context, stream jetstream.Stream, id uint64) error {
	err := stream.DeleteMsg(ctx, id)
	if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("delete dead letter %d: %w", id, err)
	}
	return nil
}

// redrive is what retry does for the records of one (group, rule, db).
type redrive struct {
	group    events.Group
	rule, db string
	since    string // on_change: where the rule resumes in db ("": the checkpoint stays)
	recs     []deadLetter
	skip     string // why the records are kept rather than re-driven
}

// planRedrives groups recs by (group, rule, db), oldest record first, and decides what each
// group's retry does: an on_change rule resumes from the earliest resume point among its records
// (the seq just before the earliest failed change); a replicator db gets a job.
func planRedrives(recs []deadLetter, set *rules.Set) []*redrive {
	byKey := map[string]*redrive{}
	var plans []*redrive
	for _, r := range slices.Backward(recs) {
		key := string(r.Group) + "\x00" + r.Rule + "\x00" + r.DB
		p := byKey[key]
		if p == nil {
			p = &redrive{group: r.Group, rule: r.Rule, db: r.DB}
			byKey[key] = p
			plans = append(plans, p)
		}
		p.recs = append(p.recs, r)
	}
	for _, p := range plans {
		rule, ok := set.Rule(p.rule)
		switch {
		case p.rule == "":
			p.skip = "the record names no rule"
		case !ok || !rule.Enabled():
			p.skip = fmt.Sprintf("rule %q no longer exists, is invalid or is disabled", p.rule)
		case !rule.MatchesDB(p.db):
			p.skip = fmt.Sprintf("rule %q no longer matches the db", p.rule)
		case rule.Group() != p.group:
			p.skip = fmt.Sprintf("rule %q is now of kind %s", p.rule, rule.Kind())
		case p.group == events.GroupOnChange:
			for _, r := range p.recs {
				switch {
				case r.Since != "" && (p.since == "" || seqAfter(p.since, r.Since)):
					p.since = r.Since
				case r.Since == "" && r.Seq != "":
					p.skip = fmt.Sprintf("record %d was written without a resume point: use producer replay --rule %s --db '^%s$' --since <the seq before %s>",
						r.ID, p.rule, regexp.QuoteMeta(p.db), r.Seq)
				}
			}
		}
	}
	return plans
}

// seqAfter reports whether seq a is after seq b in one db's feed, comparing the numbers that
// lead both PouchDB's and CouchDB's seqs (CouchDB's is the sum of its shards' positions, which
// only grows along a feed). When either has no number it answers true: a re-drive then moves
// back rather than risk skipping a change.
func seqAfter(a, b string) bool {
	na, errA := strconv.ParseUint(leadingDigits(a), 10, 64)
	nb, errB := strconv.ParseUint(leadingDigits(b), 10, 64)
	if errA != nil || errB != nil {
		return true
	}
	return na > nb
}

func leadingDigits(s string) string {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return s[:i]
}

func describePlans(plans []*redrive) string {
	var b strings.Builder
	n := 0
	for _, p := range plans {
		if p.skip == "" {
			n += len(p.recs)
		}
	}
	fmt.Fprintf(&b, "This re-drives %d dead letters and deletes them:\n", n)
	for _, p := range plans {
		fmt.Fprintf(&b, "  %s\n", p.describe(false))
	}
	return strings.TrimSuffix(b.String(), "\n")
}

func (p *redrive) describe(done bool) string {
	what := fmt.Sprintf("%-9s rule %s, db %s (%d records): ", p.group, dash(p.rule), p.db, len(p.recs))
	switch {
	case p.skip != "":
		return what + "kept: " + p.skip
	case p.since != "" && done:
		return what + "resumed from seq " + shorten(p.since, 24) + ", job enqueued, records deleted"
	case p.since != "":
		return what + "resume from seq " + shorten(p.since, 24) + " (the checkpoint moves back only if it is past it) and enqueue the db"
	case done:
		return what + "job enqueued, records deleted"
	default:
		return what + "enqueue the db"
	}
}

// redriver carries out redrive plans.
type redriver struct {
	couch  *couch.Client
	store  *checkpoint.OnChangeStore
	jobs   *natsjs.Jobs
	stream jetstream.Stream
}

// run carries out plans, printing a line for each. Records are deleted only once their job is
// enqueued (a pending job is as good: it runs from the checkpoint just moved).
func (rd *redriver) run(ctx context.Context, plans []*redrive, out io.Writer) error {
	redriven, kept := 0, 0
	for _, p := range plans {
		if p.skip == "" {
			if err := rd.redrive(ctx, p); err != nil {
				if ctx.Err() != nil {
					return err
				}
				p.skip = err.Error()
			}
		}
		fmt.Fprintln(out, p.describe(true))
		if p.skip != "" {
			kept += len(p.recs)
			continue
		}
		for _, r := range p.recs {
			if err := deleteRecord(ctx, rd.stream, r.ID); err != nil {
				return err
			}
		}
		redriven += len(p.recs)
	}
	fmt.Fprintf(out, "re-drove and deleted %d dead letters; kept %d\n", redriven, kept)
	if redriven == 0 {
		return errors.New("no dead letter could be re-driven (see the reasons above)")
	}
	return nil
}

func (rd *redriver) redrive(ctx context.Context, p *redrive) error {
	if _, err := rd.couch.DBInfo(ctx, p.db); errors.Is(err, couch.ErrNotFound) {
		return errors.New("the db no longer exists")
	} else if err != nil {
		return fmt.Errorf("read db %s: %w", p.db, err)
	}
	if p.since != "" {
		cur, err := rd.store.Load(ctx, p.rule, p.db)
		if err != nil {
			return err
		}
		// No checkpoint: the rule would start at its own start (maybe "now"). A checkpoint at the
		// beginning, or before the resume point, reaches the changes anyway.
		if !cur.Found || cur.LastSeq != "" && seqAfter(cur.LastSeq, p.since) {
			if err := rd.store.Reset(ctx, p.rule, p.db, p.since); err != nil {
				return err
			}
		}
	}
	_, err := rd.jobs.Offer(ctx, p.group, events.Job{DB: p.db, Reason: events.ReasonResync, At: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("enqueue %s: %w", p.db, err)
	}
	return nil
}
