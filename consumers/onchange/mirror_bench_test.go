package main

import (
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// BenchmarkMirrorPage writes pages of 100 changed docs into a mirror bucket (embedded NATS): one
// write at a time ("block": true) and SPIEGEL_REQUEST_CONCURRENCY (10) at once.
// Each write is a read of the key and a conditional write.
func BenchmarkMirrorPage(b *testing.B) {
	ns := natstest.Start(b)
	nc, js := ns.Connect(b)
	log := logrus.New()
	log.SetOutput(io.Discard)
	for _, block := range []bool{true, false} {
		b.Run(fmt.Sprintf("block=%t", block), func(b *testing.B) {
			r, err := rules.Parse("mir", fmt.Appendf(nil, `{"type":"on_change","mirror":"BENCH","block":%t}`, block))
			require.NoError(b, err)
			h := &handler{mirrors: newMirrorWriter(js, 1, nc.MaxPayload), dead: &noDeadLetters{}, log: log,
				inlineRetry: time.Second, book: newRetryBook(), requestConcurrency: 10}
			page := make([]couch.Change, 100)
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				for j := range page {
					id, rev := fmt.Sprintf("doc%03d", j), fmt.Sprintf("%d-%032x", i+1, j)
					page[j] = couch.Change{Seq: fmt.Sprint(i*100 + j + 1), ID: id, Revs: []string{rev},
						Doc: fmt.Appendf(nil, `{"_id":%q,"_rev":%q,"n":%d,"text":"some payload text"}`, id, rev, i)}
				}
				res := h.processBatch(b.Context(), "db", r.(*rules.OnChange), "", "", page, log)
				require.NoError(b, res.err)
				require.Equal(b, len(page), res.done)
			}
			b.ReportMetric(float64(b.N*len(page))/b.Elapsed().Seconds(), "docs/s")
		})
	}
}
