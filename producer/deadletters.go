package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
)

const deadLettersHelp = `list: the dead-letter records that match, newest first (50 unless --limit; --before ID shows
  the next page): id, time, group, rule, db, seq, doc id, status, attempts, error.
retry: re-drive them, then delete them. An on_change record resumes its rule in its db from just
  before the failed change (the checkpoint moves back only if it is past that point; later
  changes are dispatched again too); a replicator record enqueues its db. Records whose rule or
  db is gone are kept, with the reason. Asks for confirmation unless --yes.
purge: delete them. Asks for confirmation unless --yes.
--json: list prints an array of records; retry {"redriven", "kept", "plans": [{"group", "rule",
"db", "records", "kept"}]}; purge {"deleted"}.`

// deadLetterOpts are the flags of one `producer deadletters` run.
type deadLetterOpts struct {
	sub    string
	filter admin.Filter
	json   bool
	yes    bool
}

type deadLetterFlagValues struct {
	group, rule, db, since *string
	before                 *uint64
	limit                  *int
	json, yes              *bool
}

// deadLetterFlags defines the flags of subcommand sub (list's --limit defaults to 50).
func deadLetterFlags(fs *flag.FlagSet, sub string) deadLetterFlagValues {
	return deadLetterFlagValues{
		group:  fs.String("group", "", "only records of this `GROUP`: replicate or onchange"),
		rule:   fs.String("rule", "", "only records of this rule `ID`"),
		db:     fs.String("db", "", "only records of dbs matching this `REGEX` (RE2)"),
		since:  fs.String("since", "", "only records at most this `AGE` old (e.g. 90m, 24h, 7d)"),
		before: fs.Uint64("before", 0, "only records with a smaller `ID` (the next page of list)"),
		limit:  fs.Int("limit", map[string]int{"list": 50}[sub], "at most `N` records, newest first (0: all; list: 50)"),
		json:   fs.Bool("json", false, "print JSON"),
		yes:    fs.Bool("yes", false, "do not ask for confirmation (retry, purge)"),
	}
}

// parseDeadLetters parses `deadletters SUBCOMMAND [flags]` without I/O.
func parseDeadLetters(args []string) (*deadLetterOpts, error) {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return nil, usageError{errors.New("want a subcommand: list, retry or purge")}
	}
	sub, args := args[0], args[1:]
	if sub != "list" && sub != "retry" && sub != "purge" {
		return nil, usageError{fmt.Errorf("unknown command %q: want list, retry or purge", sub)}
	}
	fs := flag.NewFlagSet("deadletters "+sub, flag.ContinueOnError)
	v := deadLetterFlags(fs, sub)
	if err := parseFlags(fs, args, false); err != nil {
		return nil, err
	}
	o := &deadLetterOpts{sub: sub, json: *v.json, yes: *v.yes,
		filter: admin.Filter{Group: events.Group(*v.group), Rule: *v.rule, Before: *v.before, Limit: *v.limit}}
	f := &o.filter
	if f.Group != "" && !slices.Contains(events.Groups, f.Group) {
		return nil, usageError{fmt.Errorf("--group %q: unknown group, want replicate or onchange", *v.group)}
	}
	if f.Limit < 0 {
		return nil, usageError{fmt.Errorf("--limit %d: want 0 (all) or more", f.Limit)}
	}
	var err error
	if f.DB, err = dbFlagRegexp(*v.db); err != nil {
		return nil, err
	}
	if f.Since, err = parseAge(*v.since); err != nil {
		return nil, usageError{fmt.Errorf("--since %q: %w", *v.since, err)}
	}
	return o, nil
}

// runDeadLetters is `producer deadletters list|retry|purge [filters]`.
func runDeadLetters(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	o, err := parseDeadLetters(cio.args)
	if err != nil {
		return err
	}
	sub, f := o.sub, o.filter
	d, set, err := admin.Open(ctx, cfg, discardLogger(), 16, events.Groups...)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	stream, err := d.JS.Stream(ctx, d.Topo.Subjects.DeadLetterStream())
	if err != nil {
		return fmt.Errorf("open the dead-letter stream %s: %w", d.Topo.Subjects.DeadLetterStream(), err)
	}
	if sub == "list" {
		return listDeadLetters(ctx, cio, stream, d.Topo.Subjects, f, o.json)
	}
	var recs []admin.Record
	if err := admin.EachDeadLetter(ctx, stream, d.Topo.Subjects, f, func(r admin.Record) bool {
		recs = append(recs, r)
		return f.Limit == 0 || len(recs) < f.Limit
	}); err != nil {
		return err
	}
	if len(recs) == 0 {
		return errors.New("no dead letter matches the filters: nothing to " + sub)
	}
	if sub == "purge" {
		if !o.yes && !confirm(cio, fmt.Sprintf("This deletes %d dead letters.", len(recs))) {
			return usageError{errors.New("not confirmed; nothing was deleted (use --yes to skip the question)")}
		}
		for _, r := range recs {
			if err := admin.DeleteRecord(ctx, stream, r.ID); err != nil {
				return err
			}
		}
		if o.json {
			return printJSON(cio.stdout, map[string]int{"deleted": len(recs)})
		}
		fmt.Fprintf(cio.stdout, "deleted %d dead letters\n", len(recs))
		return nil
	}
	rd, err := admin.NewRedriver(ctx, d, stream)
	if err != nil {
		return err
	}
	plans := admin.PlanRedrives(recs, set)
	if !o.yes && !confirm(cio, describePlans(plans)) {
		return usageError{errors.New("not confirmed; nothing was re-driven (use --yes to skip the question)")}
	}
	done := []redriveJSON{}
	redriven, kept, err := rd.Run(ctx, plans, func(p *admin.Redrive) {
		if o.json {
			done = append(done, redriveJSON{Group: string(p.Group), Rule: p.Rule, DB: p.DB, Records: len(p.Recs), Since: p.Since, Kept: p.Skip})
		} else {
			fmt.Fprintln(cio.stdout, describe(p, true))
		}
	})
	if err != nil {
		return err
	}
	if o.json {
		if err := printJSON(cio.stdout, map[string]any{"redriven": redriven, "kept": kept, "plans": done}); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(cio.stdout, "re-drove and deleted %d dead letters; kept %d\n", redriven, kept)
	}
	if redriven == 0 {
		return errors.New("no dead letter could be re-driven (see the reasons above)")
	}
	return nil
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

// listDeadLetters prints the records f selects, newest first, as a table (or JSON) while it
// reads them, at most f.Limit (0: all), and says how to see the next page. What it holds in
// memory is bounded by a span and a block of rows, whatever the number of records.
func listDeadLetters(ctx context.Context, cio cmdIO, stream jetstream.Stream, subjects events.Subjects, f admin.Filter, asJSON bool) error {
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
	err := admin.EachDeadLetter(ctx, stream, subjects, f, func(r admin.Record) bool {
		if f.Limit > 0 && n == f.Limit {
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
			if block++; block == admin.DeadLetterSpan {
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
func printDeadLetter(w io.Writer, r admin.Record) {
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

// describePlans is the question retry asks before it re-drives plans.
func describePlans(plans []*admin.Redrive) string {
	var b strings.Builder
	n := 0
	for _, p := range plans {
		if p.Skip == "" {
			n += len(p.Recs)
		}
	}
	fmt.Fprintf(&b, "This re-drives %d dead letters and deletes them:\n", n)
	for _, p := range plans {
		fmt.Fprintf(&b, "  %s\n", describe(p, false))
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// describe says what retry does (done: did) with the records of p.
func describe(p *admin.Redrive, done bool) string {
	what := fmt.Sprintf("%-9s rule %s, db %s (%d records): ", p.Group, dash(p.Rule), p.DB, len(p.Recs))
	switch {
	case p.Skip != "":
		return what + "kept: " + p.Skip
	case p.Since != "" && done:
		return what + "resumed from seq " + shorten(p.Since, 24) + ", job enqueued, records deleted"
	case p.Since != "":
		return what + "resume from seq " + shorten(p.Since, 24) + " (the checkpoint moves back only if it is past it) and enqueue the db"
	case done:
		return what + "job enqueued, records deleted"
	default:
		return what + "enqueue the db"
	}
}

// redriveJSON is one plan of `deadletters retry --json`: what became of the records of one
// group, rule and db.
type redriveJSON struct {
	Group   string `json:"group"`
	Rule    string `json:"rule,omitempty"`
	DB      string `json:"db"`
	Records int    `json:"records"`
	Since   string `json:"resumed_from,omitempty"`
	Kept    string `json:"kept,omitempty"`
}
