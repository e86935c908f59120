package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// printProcesses prints one line per running process, as its NATS service answered.
func printProcesses(out io.Writer, procs []status.Report) {
	fmt.Fprintf(out, "\nprocesses (%d answering)\n", len(procs))
	if len(procs) == 0 {
		fmt.Fprintln(out, "  none: no producer or consumer of this subject prefix answered")
		return
	}
	w := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "  SERVICE\tID\tVERSION\tHOST\tUP\tIN FLIGHT\tSTATE")
	for _, p := range procs {
		var state []string
		if ps := p.Producer; ps != nil {
			feed := "feed ok"
			if !ps.FeedOK {
				feed = "feed not running"
			}
			state = append(state, fmt.Sprintf("source %s, %s, position %s, hot feeds %d", orDash(ps.Source), feed, orDash(shortSeq(ps.Position)), ps.HotFeeds))
			if l := ps.StreamLoss; l != nil {
				state = append(state, fmt.Sprintf("changes stream loss %s ago: %s", ago(l.At), l.Text))
			}
		} else {
			state = append(state, fmt.Sprintf("jobs ok %d, retried %d, failed %d", p.Jobs["ok"], p.Jobs["retry"], p.Jobs["failed"]))
		}
		if e := p.LastError; e != nil {
			state = append(state, fmt.Sprintf("last error %s ago: %s", ago(e.At), e.Text))
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\t%d\t%s\n", p.Service, p.ID, p.Version, orDash(p.Host), ago(p.Started), p.InFlight, strings.Join(state, "; "))
	}
	_ = w.Flush()
}

// printPerRule prints the per-rule table, then each rule's last error.
func printPerRule(out io.Writer, rs []admin.RuleStatus, incomplete string) {
	fmt.Fprintf(out, "\nrules (%d)\n", len(rs))
	w := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "  RULE\tKIND\tPATTERN\tENGINE\tENABLED\tDBS\tBEHIND\tOLDEST UNPROCESSED\tLAST RUN\tRESULT\tFAILURES 1H\tDEAD LETTERS")
	for _, r := range rs {
		enabled := "yes"
		if !r.Enabled {
			enabled = "no"
		}
		behind, oldest := "-", "-"
		if r.DBsBehind != nil {
			behind = fmt.Sprint(*r.DBsBehind)
			if r.DBsBehindNoJob > 0 {
				behind += fmt.Sprintf(" (%d without job)", r.DBsBehindNoJob)
			}
			if r.DBsUnchecked > 0 {
				behind += fmt.Sprintf(" (%d unchecked)", r.DBsUnchecked)
			}
		}
		if r.OldestAgeSeconds != nil {
			oldest = fmt.Sprintf("%s (%s)", (time.Duration(*r.OldestAgeSeconds * float64(time.Second))).Round(time.Second), r.OldestDB)
		}
		lastRun := "-"
		if r.LastRun != nil {
			lastRun = ago(*r.LastRun) + " ago"
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%d\t%d\n", r.ID, r.Kind, orDash(r.Pattern), orDash(r.Engine), enabled,
			r.DBsMatched, behind, oldest, lastRun, orDash(r.LastResult), r.FailuresLastHour, r.DeadLetters)
	}
	_ = w.Flush()
	for _, r := range rs {
		if r.LastError != "" {
			fmt.Fprintf(out, "  %s: last error: %s\n", r.ID, r.LastError)
		}
		if g := r.LastGap; g != nil {
			fmt.Fprintf(out, "  %s: %d gap(s) in its output; the latest %s ago in db %s: %s\n", r.ID, r.Gaps, ago(g.At), g.DB, g.Text)
		}
	}
	if incomplete != "" {
		fmt.Fprintf(out, "  incomplete: %s\n", incomplete)
	}
}

func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return time.Since(t).Round(time.Second).String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// shortSeq cuts CouchDB's long opaque seqs for a terminal ("12-g1AAAA…").
func shortSeq(s string) string {
	if len(s) > 24 {
		return s[:24] + "…"
	}
	return s
}
