package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// status --check: healthy only with a producer whose feed runs, no recent process error, no
// rejected rule, no gap and no stream loss; each reason is named on the one line printed.
func TestStatusCheck(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	producerOK := status.Report{Component: status.ComponentProducer, ID: "p1", Host: "h1", Producer: &status.ProducerState{FeedOK: true}}
	consumer := status.Report{Component: status.ComponentOnChange, ID: "c1"}
	cases := []struct {
		name   string
		edit   func(r *admin.StatusReport)
		reason string // "": healthy
	}{
		{"healthy", func(*admin.StatusReport) {}, ""},
		{"an old error", func(r *admin.StatusReport) {
			r.Processes[1].LastError = &status.ErrorNote{At: now.Add(-2 * time.Hour), Text: "old"}
		}, ""},
		{"no producer", func(r *admin.StatusReport) { r.Processes = r.Processes[1:] }, "no producer answers"},
		{"feed down", func(r *admin.StatusReport) { r.Processes[0].Producer.FeedOK = false },
			"the feed of producer p1 on h1 is not running"},
		{"recent error", func(r *admin.StatusReport) {
			r.Processes[1].LastError = &status.ErrorNote{At: now.Add(-10 * time.Minute), Text: "webhook 500"}
		}, "onchange c1 reports an error 10m0s ago: webhook 500"},
		{"rejected rule", func(r *admin.StatusReport) { r.Rules.Rejected = map[string]string{"bad": "db_name: missing"} },
			"rule bad is rejected: db_name: missing"},
		{"gap", func(r *admin.StatusReport) { r.PerRule = []admin.RuleStatus{{ID: "r1", Gaps: 2}} },
			"rule r1 reports 2 gap(s) in its output"},
		{"stream loss", func(r *admin.StatusReport) {
			r.Processes[0].Producer.StreamLoss = &status.ErrorNote{At: now.Add(-time.Minute), Text: "first seq moved"}
		}, "producer p1 on h1 reports a loss of the changes stream 1m0s ago: first seq moved"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := producerOK
			ps := *producerOK.Producer
			p.Producer = &ps
			rep := &admin.StatusReport{Processes: []status.Report{p, consumer}}
			c.edit(rep)

			var out bytes.Buffer
			err := reportHealth(&out, rep, false, now)
			lines := strings.Split(strings.TrimSpace(out.String()), "\n")
			require.Len(t, lines, 1, "one line")
			var js bytes.Buffer
			jerr := reportHealth(&js, rep, true, now)
			var verdict struct {
				Healthy bool     `json:"healthy"`
				Reasons []string `json:"reasons"`
			}
			require.NoError(t, json.Unmarshal(js.Bytes(), &verdict))
			if c.reason == "" {
				require.NoError(t, err)
				require.NoError(t, jerr)
				assert.True(t, strings.HasPrefix(lines[0], "ok: "), lines[0])
				assert.True(t, verdict.Healthy)
				assert.Empty(t, verdict.Reasons)
				return
			}
			var unhealthy unhealthyError
			require.ErrorAs(t, err, &unhealthy)
			require.ErrorAs(t, jerr, &unhealthy)
			assert.Contains(t, lines[0], "unhealthy: ")
			assert.Contains(t, lines[0], c.reason)
			assert.False(t, verdict.Healthy)
			assert.Contains(t, strings.Join(verdict.Reasons, "\n"), c.reason)
			assert.Equal(t, exitUnhealthy, exitCode("status", err, discardLogger(), &bytes.Buffer{}))
		})
	}
}
