package chaos

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Storage loss is a detection check.
//
// With CHAOS_STORE_LOSS=1 NATS nodes come back from copies of their stores taken seconds
// earlier: JetStream loses messages it had acknowledged, which no durable deployment meets
// (sync_interval always, as the run's nodes have). What is ours (jobs, markers, records, caches)
// the sweep heals from CouchDB; what readers consume (the change stream, the mirror) is never
// rewritten: a tail lost from SPIEGEL_CHANGES is published again after what remains, a gap in
// the middle or in the mirror is reported. So after storage loss the verdict accepts changes
// missing from the stream and mirror entries that differ — provided the pipeline reported a
// loss (spiegel_change_stream_losses_total or spiegel_output_gaps_total went up) within one
// sweep interval and the jobs it starts of the loss's end (gapLimit). Order violations stay
// failures: nothing readers had may be reordered.

// gapMetrics are the counters of a reported loss, in the producers' and the consumers' metrics.
var gapMetrics = []string{"spiegel_change_stream_losses_total", "spiegel_output_gaps_total"}

// gapWatch scrapes every product process's /metrics and records when the sum of gapMetrics went
// up: a report of a loss. A process restarted by a fault starts its counters at 0 again, which
// costs nothing: only increases count.
type gapWatch struct {
	client *http.Client

	mu      sync.Mutex
	last    map[string]float64 // per metrics URL, the sum at the previous scrape
	reports []time.Duration    // on the run's clock
}

func newGapWatch() *gapWatch {
	return &gapWatch{client: &http.Client{Timeout: 2 * time.Second}, last: map[string]float64{}}
}

// watch scrapes urls every interval until ctx ends; since gives the run's clock.
func (g *gapWatch) watch(ctx context.Context, urls func() []string, since func() time.Duration, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		for _, u := range urls() {
			if sum, ok := g.scrape(ctx, u); ok {
				g.note(u, sum, since())
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// note records sum as scraped from url at at, and a report when it went up.
func (g *gapWatch) note(url string, sum float64, at time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if sum > g.last[url] {
		g.reports = append(g.reports, at)
	}
	g.last[url] = sum
}

// scrape returns the sum of gapMetrics that url serves (false: no answer).
func (g *gapWatch) scrape(ctx context.Context, url string) (float64, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, false
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, false
	}
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		for _, m := range gapMetrics {
			if !strings.HasPrefix(line, m) {
				continue
			}
			fields := strings.Fields(line)
			if v, err := strconv.ParseFloat(fields[len(fields)-1], 64); err == nil {
				sum += v
			}
		}
	}
	return sum, sc.Err() == nil
}

// firstAfter returns the first report at or after from (false: none).
func (g *gapWatch) firstAfter(from time.Duration) (time.Duration, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, at := range g.reports {
		if at >= from {
			return at, true
		}
	}
	return 0, false
}

// count returns the reports recorded.
func (g *gapWatch) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.reports)
}

// storeLossVerdict judges the gaps v found after storage loss (see the top of this file): they
// are accepted when a loss was reported within limit of the end of a storage-loss fault, and
// are failures otherwise. It returns the failures and a note for the summary.
func storeLossVerdict(v *verdict, faults []faultRecord, g *gapWatch, limit time.Duration) (failures []string, note string) {
	gaps := len(v.StreamMissing) + len(v.MirrorMismatch)
	var losses []faultRecord
	for _, f := range faults {
		if f.Kind == FaultNATSStoreLoss || f.Kind == FaultNATSStoreLossAll {
			losses = append(losses, f)
		}
	}
	note = fmt.Sprintf("%d storage-loss faults; %d loss reports; %d change(s) missing from the stream and %d mirror entries differing after them",
		len(losses), g.count(), len(v.StreamMissing), len(v.MirrorMismatch))
	if gaps == 0 {
		return nil, note
	}
	if len(losses) == 0 {
		return []string{"changes missing from the stream or the mirror without storage loss"}, note
	}
	for _, f := range losses {
		at, ok := g.firstAfter(f.Started)
		switch {
		case ok && at <= f.Ended+limit:
			note += fmt.Sprintf("; loss at +%s reported %s after its end", f.Started.Round(time.Second), (at - f.Ended).Round(100*time.Millisecond))
			return nil, note
		case ok:
			note += fmt.Sprintf("; loss at +%s reported only %s after its end", f.Started.Round(time.Second), (at - f.Ended).Round(100*time.Millisecond))
		}
	}
	return []string{fmt.Sprintf("%d gap(s) in the stream or the mirror after storage loss, and no loss reported within %s of a storage-loss fault's end", gaps, limit)}, note
}
