package chaos

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"
)

// Time to heal: when a fault takes effect, the run writes a probe doc into the probe db of the
// fault's class (a source db the rules match like the writer's, but which the writer never
// touches) and watches it reach the three destinations — the replication target, the webhook
// sink and the change stream. A probe's heal time is how long after its fault ended the last of
// the three got it (0 when all got it before). A fault class heals in the longest heal time of
// its faults: what a user waits, after such a fault, for a change made during it.

// probe is one fault's probe doc and when it reached each destination (run clock; 0 = not yet).
type probe struct {
	Kind   FaultKind
	DB, ID string

	Written, Ended       time.Duration // CouchDB acknowledged it; its fault was over (0 = not yet)
	Rev                  string
	Target, Hook, Stream time.Duration
	writeErr             string
}

// heal is when the probe had reached every destination after its fault ended; ok is false while
// it has not.
func (p *probe) heal() (time.Duration, bool) {
	if p.Ended == 0 || p.Target == 0 || p.Hook == 0 || p.Stream == 0 {
		return 0, false
	}
	return max(0, max(p.Target, p.Hook, p.Stream)-p.Ended), true
}

// prober writes and watches the probes of a run.
type prober struct {
	r *run

	mu     sync.Mutex
	probes []*probe
}

// probeDB is the probe db of fault class k.
func (r *run) probeDB(k FaultKind) string {
	return r.prefix + "src_probe_" + strings.ReplaceAll(k.String(), "-", "_")
}

// createProbeDBs creates the probe db of every fault class.
func (p *prober) createProbeDBs(ctx context.Context) error {
	for k := range numFaultKinds {
		status, err := p.r.couch.do(ctx, http.MethodPut, "/"+p.r.probeDB(k), nil, nil)
		if err != nil || status != http.StatusCreated && status != http.StatusAccepted && status != http.StatusPreconditionFailed {
			return fmt.Errorf("create probe db %s: status %d, %v", p.r.probeDB(k), status, err)
		}
	}
	return nil
}

// begin writes the probe of a fault of class k that just took effect, in the background (CouchDB
// may be the thing that is down: the write is retried until it is acknowledged), and returns it.
func (p *prober) begin(ctx context.Context, k FaultKind) *probe {
	p.mu.Lock()
	pr := &probe{Kind: k, DB: p.r.probeDB(k), ID: fmt.Sprintf("probe_%04d", len(p.probes))}
	p.probes = append(p.probes, pr)
	p.mu.Unlock()
	go func() {
		for ctx.Err() == nil {
			var res struct {
				Rev string `json:"rev"`
			}
			status, err := p.r.couch.do(ctx, http.MethodPut, "/"+url.PathEscape(pr.DB)+"/"+pr.ID, map[string]any{"fault": k.String()}, &res)
			at := p.r.since()
			p.mu.Lock()
			switch {
			case err == nil && (status == http.StatusCreated || status == http.StatusAccepted):
				pr.Written, pr.Rev, pr.writeErr = at, res.Rev, ""
				p.mu.Unlock()
				return
			case err == nil:
				pr.writeErr = fmt.Sprintf("status %d", status)
			default:
				pr.writeErr = err.Error()
			}
			p.mu.Unlock()
			if sleepCtx(ctx, 200*time.Millisecond) != nil {
				return
			}
		}
	}()
	return pr
}

// ended records that the probe's fault is over.
func (p *prober) ended(pr *probe, at time.Duration) {
	if pr == nil {
		return
	}
	p.mu.Lock()
	pr.Ended = at
	p.mu.Unlock()
}

// watch records when each written probe reaches each destination, every interval, until ctx ends.
// The target is looked at in a loop of its own: the stream's catch-up can take seconds while
// NATS elects a leader, and must not delay (and so lengthen) the target's times.
func (p *prober) watch(ctx context.Context, interval time.Duration) {
	go func() {
		for sleepCtx(ctx, interval) == nil {
			p.checkTargets(ctx)
		}
	}()
	for sleepCtx(ctx, interval) == nil {
		p.checkStreams(ctx)
	}
}

// check looks once for every written probe that has not reached all three destinations.
func (p *prober) check(ctx context.Context) {
	p.checkTargets(ctx)
	p.checkStreams(ctx)
}

// openProbes returns copies of the written probes that miss a destination.
func (p *prober) openProbes() []probe {
	p.mu.Lock()
	defer p.mu.Unlock()
	var open []probe
	for _, pr := range p.probes {
		if pr.Rev != "" && (pr.Target == 0 || pr.Hook == 0 || pr.Stream == 0) {
			open = append(open, *pr)
		}
	}
	return open
}

// checkTargets records the probes found on their replication target, each timed when its GET
// answers.
func (p *prober) checkTargets(ctx context.Context) {
	for _, o := range p.openProbes() {
		if o.Target != 0 {
			continue
		}
		var doc struct {
			Rev string `json:"_rev"`
		}
		status, err := p.r.couch.do(ctx, http.MethodGet, "/"+url.PathEscape(p.r.targetDB(o.DB))+"/"+o.ID, nil, &doc)
		if err != nil || status != http.StatusOK || doc.Rev != o.Rev {
			continue
		}
		at := p.r.since()
		p.mu.Lock()
		for _, pr := range p.probes {
			if pr.DB == o.DB && pr.ID == o.ID && pr.Target == 0 {
				pr.Target = at
			}
		}
		p.mu.Unlock()
	}
}

// checkStreams records the probes the webhook sink got and the change stream holds, at the
// sink's and the message's own times.
func (p *prober) checkStreams(ctx context.Context) {
	open := p.openProbes()
	if len(open) == 0 {
		return
	}
	delivered := p.r.sink.firstDelivered()
	var stored map[[3]string]time.Time
	if _, err := p.r.changes.catchUp(ctx); err == nil {
		stored = map[[3]string]time.Time{}
		for _, m := range p.r.changes.all() {
			if strings.HasPrefix(m.DB, p.r.prefix+"src_probe_") {
				if _, seen := stored[[3]string{m.DB, m.ID, m.Rev}]; !seen {
					stored[[3]string{m.DB, m.ID, m.Rev}] = m.Stored
				}
			}
		}
	}
	onRunClock := func(t time.Time) time.Duration { return max(t.Sub(p.r.started), 0).Round(time.Millisecond) }
	for i := range open {
		o := &open[i]
		key := [3]string{o.DB, o.ID, o.Rev}
		if t, ok := delivered[key]; ok && o.Hook == 0 {
			o.Hook = onRunClock(t)
		}
		if t, ok := stored[key]; ok && o.Stream == 0 {
			o.Stream = onRunClock(t)
		}
	}
	p.mu.Lock()
	for _, o := range open {
		for _, pr := range p.probes {
			if pr.DB == o.DB && pr.ID == o.ID {
				pr.Hook, pr.Stream = o.Hook, o.Stream
			}
		}
	}
	p.mu.Unlock()
}

// healed reports whether every probe of an ended fault has reached every destination.
func (p *prober) healed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pr := range p.probes {
		if _, ok := pr.heal(); !ok && pr.Ended > 0 {
			return false
		}
	}
	return true
}

// classHeal is the time to heal of one fault class.
type classHeal struct {
	Kind        FaultKind
	Faults      int
	Max, Median time.Duration
	// Slowest names the destination that was last for the class's slowest probe, and when each
	// destination got that probe after its fault ended (0: before): where the time went.
	Slowest              string
	Target, Hook, Stream time.Duration
	Unhealed             []string // probes that never reached a destination, and why
}

// summary returns the time to heal of every fault class that ran, in class order.
func (p *prober) summary() []classHeal {
	p.mu.Lock()
	defer p.mu.Unlock()
	byKind := map[FaultKind]*classHeal{}
	times := map[FaultKind][]time.Duration{}
	for _, pr := range p.probes {
		c := byKind[pr.Kind]
		if c == nil {
			c = &classHeal{Kind: pr.Kind}
			byKind[pr.Kind] = c
		}
		c.Faults++
		d, ok := pr.heal()
		if !ok {
			var missing []string
			for _, x := range []struct {
				name string
				at   time.Duration
			}{{"target", pr.Target}, {"webhook", pr.Hook}, {"stream", pr.Stream}} {
				if x.at == 0 {
					missing = append(missing, x.name)
				}
			}
			why := "not in " + strings.Join(missing, ", ")
			if pr.Rev == "" {
				why = "never written: " + pr.writeErr
			}
			c.Unhealed = append(c.Unhealed, fmt.Sprintf("%s/%s (%s)", pr.DB, pr.ID, why))
			continue
		}
		times[pr.Kind] = append(times[pr.Kind], d)
		if d >= c.Max {
			c.Max = d
			after := func(at time.Duration) time.Duration { return max(0, at-pr.Ended) }
			c.Target, c.Hook, c.Stream = after(pr.Target), after(pr.Hook), after(pr.Stream)
			c.Slowest = "target"
			if pr.Hook >= pr.Target && pr.Hook >= pr.Stream {
				c.Slowest = "webhook"
			} else if pr.Stream >= pr.Target {
				c.Slowest = "stream"
			}
		}
	}
	var out []classHeal
	for k := range numFaultKinds {
		c := byKind[k]
		if c == nil {
			continue
		}
		if ts := times[k]; len(ts) > 0 {
			slices.Sort(ts)
			c.Max, c.Median = ts[len(ts)-1], ts[len(ts)/2]
		}
		out = append(out, *c)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Kind < out[j].Kind })
	return out
}

// writeTimes writes every probe's times (run clock) as tab-separated lines, slowest heal first:
// where to look in the processes' logs for what a heal waited on.
func (p *prober) writeTimes(w io.Writer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	probes := slices.Clone(p.probes)
	heal := func(pr *probe) time.Duration {
		if d, ok := pr.heal(); ok {
			return d
		}
		return time.Duration(1<<63 - 1) // never: first
	}
	sort.SliceStable(probes, func(i, j int) bool { return heal(probes[i]) > heal(probes[j]) })
	r := func(d time.Duration) string { return d.Round(10 * time.Millisecond).String() }
	fmt.Fprintln(w, "class\tdb\tdoc\trev\twritten\tfault_ended\ttarget\twebhook\tstream\theal")
	for _, pr := range probes {
		h := "never"
		if d, ok := pr.heal(); ok {
			h = r(d)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", pr.Kind, pr.DB, pr.ID, pr.Rev,
			r(pr.Written), r(pr.Ended), r(pr.Target), r(pr.Hook), r(pr.Stream), h)
	}
}

// String is one class's time to heal, as the verdict prints it.
func (c classHeal) String() string {
	r := func(d time.Duration) time.Duration { return d.Round(100 * time.Millisecond) }
	s := fmt.Sprintf("%s max %s, median %s (%d)", c.Kind, r(c.Max), r(c.Median), c.Faults)
	if c.Slowest != "" && c.Max > 0 {
		s += fmt.Sprintf(" [max: %s last; target %s, webhook %s, stream %s]", c.Slowest, r(c.Target), r(c.Hook), r(c.Stream))
	}
	if len(c.Unhealed) > 0 {
		s += fmt.Sprintf(", %d not healed", len(c.Unhealed))
	}
	return s
}
