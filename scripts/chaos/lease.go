package chaos

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
)

// The lease verdict: no side effect by an instance after its lease ran out.
//
// What is observable: the sink sees when each webhook call arrived and which process made it
// (X-Spiegel-Instance: "<hostname>/<pid>", mapped to the run's processes by pid); the run
// knows when it partitioned which process from NATS (FaultPartitionNATS, freeze or cut; the
// fault record's Began is taken once the proxies are frozen or cut, Ended when they are
// released).
//
// The rule: an onchange instance partitioned from NATS at t0 holds no lease beyond t0 +
// AckWait — every job it holds was last renewed by an InProgress the server confirmed before
// t0, and the server redelivers it AckWait after that — so it must make no webhook call that
// arrives after t0 + AckWait + margin while the partition lasts. The margin is the rule's
// timeout (hookTimeout): a request sent just before the lease ran out may take that long to
// arrive. A call in that window is a violation and fails the run.
//
// Also reported, not failing: how late the partitioned instance's last call came, and how soon
// another instance called for a db the partitioned one had called for in the AckWait before the
// partition (the successor taking the job over, or a later job of that db).

// leaseResult is the lease verdict of a run.
type leaseResult struct {
	Partitions, Freezes int           // NATS partitions of onchange instances (freezes among them)
	Calls               int           // webhook calls by partitioned instances during their partitions
	Latest              time.Duration // the latest of them, after its partition began
	Limit               time.Duration // AckWait + margin
	Successor           []time.Duration
	Unidentified        int // calls without a usable X-Spiegel-Instance
	Violations          []string
}

// pidOfInstance returns the pid of an X-Spiegel-Instance value "<hostname>/<pid>" (0 when it is
// not one).
func pidOfInstance(instance string) int {
	i := strings.LastIndexByte(instance, '/')
	if i < 0 {
		return 0
	}
	pid, err := strconv.Atoi(instance[i+1:])
	if err != nil {
		return 0
	}
	return pid
}

// leaseVerdict checks calls against the NATS partitions of onchange instances among records.
// procPIDs maps each process name to the pids of its incarnations; started is the run's start.
func leaseVerdict(records []faultRecord, calls []sinkCall, procPIDs map[string][]int, started time.Time,
	ackWait, margin time.Duration) leaseResult {
	res := leaseResult{Limit: ackWait + margin}
	owner := map[int]string{}
	for name, pids := range procPIDs {
		for _, pid := range pids {
			owner[pid] = name
		}
	}
	type call struct {
		at   time.Duration
		proc string
		sinkCall
	}
	var cs []call
	for _, c := range calls {
		proc := owner[pidOfInstance(c.Instance)]
		if proc == "" {
			res.Unidentified++
			continue
		}
		cs = append(cs, call{at: c.At.Sub(started), proc: proc, sinkCall: c})
	}
	sort.SliceStable(cs, func(i, j int) bool { return cs[i].at < cs[j].at })
	for _, rec := range records {
		if rec.Kind != FaultPartitionNATS || rec.Skipped != "" || rec.Began == 0 || !strings.HasPrefix(procNames[rec.Target], "onchange") {
			continue
		}
		name := procNames[rec.Target]
		res.Partitions++
		if !rec.Cut {
			res.Freezes++
		}
		t0, t1 := rec.Began, rec.Ended
		mode := map[bool]string{false: "froze", true: "was cut"}[rec.Cut]
		recent := map[string]bool{} // dbs it called for in the AckWait before the partition
		succ := map[string]bool{}
		var first time.Duration = -1
		for _, c := range cs {
			switch {
			case c.proc == name && c.at >= t0-ackWait && c.at < t0:
				recent[c.DB] = true
			case c.proc == name && c.at >= t0 && c.at <= t1:
				res.Calls++
				res.Latest = max(res.Latest, c.at-t0)
				if c.at > t0+res.Limit {
					res.Violations = append(res.Violations, fmt.Sprintf(
						"%s (%s) called the webhook for %s %s %s at +%s, %s after its NATS link %s at +%s (its lease ran out by %s; the partition lasted until +%s)",
						name, c.Instance, c.DB, c.ID, c.Rev, c.at, (c.at-t0).Round(time.Millisecond), mode, t0, res.Limit, t1))
				}
			case c.proc != name && strings.HasPrefix(c.proc, "onchange") && c.at >= t0 && c.at <= t1+ackWait && recent[c.DB] && !succ[c.DB]:
				succ[c.DB] = true
				if first < 0 || c.at-t0 < first {
					first = c.at - t0
				}
			}
		}
		if first >= 0 {
			res.Successor = append(res.Successor, first)
		}
	}
	return res
}

// String is the verdict line.
func (l leaseResult) String() string {
	succ := "no successor seen"
	if len(l.Successor) > 0 {
		s := append([]time.Duration(nil), l.Successor...)
		sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
		succ = fmt.Sprintf("another instance first called for a db the partitioned one had called for in the AckWait before, %s–%s after the partition began (%d partitions)",
			s[0].Round(100*time.Millisecond), s[len(s)-1].Round(100*time.Millisecond), len(s))
	}
	return fmt.Sprintf("%d NATS partitions of onchange instances (%d freezes, %d cuts); %d webhook calls by a partitioned instance during them, "+
		"the latest %s after its partition began (limit AckWait + rule timeout = %s); %s; %d calls without X-Spiegel-Instance; %d violations",
		l.Partitions, l.Freezes, l.Partitions-l.Freezes, l.Calls, l.Latest.Round(time.Millisecond), l.Limit, succ, l.Unidentified, len(l.Violations))
}
