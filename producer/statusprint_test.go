package main

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// producer status names a rule's latest gap in its output (rule, db, what is missing) and the
// producer's latest loss of the changes stream.
func TestStatusPrintsGapsAndStreamLoss(t *testing.T) {
	var out strings.Builder
	at := time.Now().Add(-time.Minute)
	printProcesses(&out, []status.Report{{Service: "spiegel-producer", ID: "p1", Started: at,
		Producer: &status.ProducerState{Source: "db_updates", FeedOK: true,
			StreamLoss: &status.ErrorNote{At: at, Text: "stream SPIEGEL_CHANGES went back from sequence 9 to 7"}}}})
	printPerRule(&out, []admin.RuleStatus{{ID: "pub", Kind: "on_change", Enabled: true, Gaps: 2,
		LastGap: &status.GapNote{At: at, DB: "userdb-1", Text: "subject spiegel.changes.userdb-1 lacks 2 of the messages at positions 1 to 7"}}}, "")
	got := out.String()
	assert.Contains(t, got, "changes stream loss 1m0s ago: stream SPIEGEL_CHANGES went back from sequence 9 to 7")
	assert.Contains(t, got, "pub: 2 gap(s) in its output; the latest 1m0s ago in db userdb-1: subject spiegel.changes.userdb-1 lacks 2 of the messages at positions 1 to 7")
}
