package chaos

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// After storage loss, gaps in the stream or the mirror pass only when a loss was reported within
// the limit of a storage-loss fault's end; without storage loss they never pass.
func TestStoreLossVerdict(t *testing.T) {
	loss := faultRecord{Fault: Fault{Kind: FaultNATSStoreLoss}, Started: 10 * time.Second, Ended: 20 * time.Second}
	kill := faultRecord{Fault: Fault{Kind: FaultKillProc}, Started: 5 * time.Second, Ended: 6 * time.Second}
	gapped := &verdict{StreamMissing: []string{"db/doc/1-a"}}
	reported := func(at ...time.Duration) *gapWatch {
		g := newGapWatch()
		for i, a := range at {
			g.note("u", float64(i+1), a)
		}
		return g
	}
	for _, c := range []struct {
		name   string
		v      *verdict
		faults []faultRecord
		g      *gapWatch
		pass   bool
	}{
		{"no gap", &verdict{}, []faultRecord{loss}, reported(), true},
		{"reported in time", gapped, []faultRecord{kill, loss}, reported(30 * time.Second), true},
		{"reported too late", gapped, []faultRecord{loss}, reported(90 * time.Second), false},
		{"reported before the loss only", gapped, []faultRecord{loss}, reported(5 * time.Second), false},
		{"never reported", gapped, []faultRecord{loss}, reported(), false},
		{"a gap without storage loss", gapped, []faultRecord{kill}, reported(30 * time.Second), false},
		{"mirror gap reported", &verdict{MirrorMismatch: []string{"db/doc"}}, []faultRecord{loss}, reported(25 * time.Second), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			fails, note := storeLossVerdict(c.v, c.faults, c.g, 40*time.Second)
			assert.Equal(t, c.pass, len(fails) == 0, "failures %v; note %s", fails, note)
		})
	}
}

// The gap watch counts a report when a process's gap counters go up, not when a restarted
// process starts them at 0 again, and reads both counters.
func TestGapWatchScrapes(t *testing.T) {
	var losses, gaps atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "# HELP x\nspiegel_change_stream_losses_total %d\nspiegel_output_gaps_total{kind=\"subject\"} %d\nspiegel_jobs_total 99\n", losses.Load(), gaps.Load())
	}))
	defer srv.Close()
	g := newGapWatch()
	at := time.Duration(0)
	scrape := func() {
		at += time.Second
		sum, ok := g.scrape(t.Context(), srv.URL)
		require.True(t, ok)
		g.note(srv.URL, sum, at)
	}
	scrape()
	assert.Zero(t, g.count(), "nothing reported yet")
	gaps.Store(2)
	scrape()
	assert.Equal(t, 1, g.count(), "gaps went up")
	gaps.Store(0) // the process restarted
	scrape()
	assert.Equal(t, 1, g.count(), "a reset is no report")
	losses.Store(1)
	scrape()
	assert.Equal(t, 2, g.count(), "a loss of the changes stream")
	first, ok := g.firstAfter(3 * time.Second)
	assert.True(t, ok)
	assert.Equal(t, 4*time.Second, first)
}
