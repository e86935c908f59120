package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// exitUnhealthy is the exit code of `producer status --check` when the installation is not
// healthy (0 healthy, 1 no status, 2 a bad command line).
const exitUnhealthy = 3

// errorWindow is how recent a process's last error must be for --check to report it.
const errorWindow = time.Hour

// unhealthyError is the answer of `status --check` when something is wrong: each reason.
type unhealthyError struct{ reasons []string }

func (e unhealthyError) Error() string { return "unhealthy: " + strings.Join(e.reasons, "; ") }

// checkHealth returns why the installation rep describes is not healthy (none: healthy): no
// producer answers or its db-updates feed is not running, a process reports an error within
// errorWindow before now, a rule is rejected, a rule reports a gap in its output, or a producer
// reports a loss of the changes stream. The reasons are in a stable order.
func checkHealth(rep *admin.StatusReport, now time.Time) []string {
	var reasons []string
	producers := 0
	for _, p := range rep.Processes {
		if ps := p.Producer; ps != nil {
			producers++
			if !ps.FeedOK {
				reasons = append(reasons, fmt.Sprintf("the feed of producer %s is not running", processName(p)))
			}
			if l := ps.StreamLoss; l != nil {
				reasons = append(reasons, fmt.Sprintf("producer %s reports a loss of the changes stream %s ago: %s",
					processName(p), now.Sub(l.At).Round(time.Second), l.Text))
			}
		}
		if e := p.LastError; e != nil && now.Sub(e.At) < errorWindow {
			reasons = append(reasons, fmt.Sprintf("%s %s reports an error %s ago: %s", p.Component, processName(p),
				now.Sub(e.At).Round(time.Second), e.Text))
		}
	}
	if producers == 0 {
		reasons = append([]string{"no producer answers: the feed is not running"}, reasons...)
	}
	ids := make([]string, 0, len(rep.Rules.Rejected))
	for id := range rep.Rules.Rejected {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		reasons = append(reasons, fmt.Sprintf("rule %s is rejected: %s", id, rep.Rules.Rejected[id]))
	}
	for _, r := range rep.PerRule {
		if r.Gaps > 0 {
			reasons = append(reasons, fmt.Sprintf("rule %s reports %d gap(s) in its output", r.ID, r.Gaps))
		}
	}
	return reasons
}

func processName(p status.Report) string {
	if p.Host != "" {
		return p.ID + " on " + p.Host
	}
	return p.ID
}

// reportHealth prints the verdict of checkHealth on rep: one line ("ok: ..." or "unhealthy:
// reason; reason"), or with asJSON {"healthy", "reasons"}; it returns an unhealthyError when
// there is a reason (realMain exits exitUnhealthy and prints nothing more).
func reportHealth(w io.Writer, rep *admin.StatusReport, asJSON bool, now time.Time) error {
	reasons := checkHealth(rep, now)
	switch {
	case asJSON:
		if err := printJSON(w, map[string]any{"healthy": len(reasons) == 0, "reasons": append([]string{}, reasons...)}); err != nil {
			return err
		}
	case len(reasons) == 0:
		fmt.Fprintf(w, "ok: %d processes answer, the feed runs, no errors in the last hour, no rule rejected\n", len(rep.Processes))
	default:
		fmt.Fprintln(w, unhealthyError{reasons}.Error())
	}
	if len(reasons) > 0 {
		return unhealthyError{reasons}
	}
	return nil
}
