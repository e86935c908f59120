package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// TestPagesGrowForOutputRules: a job whose rules all publish or mirror reads, after a full page,
// pages as large as its docs let fit in half of pageBytes, up to maxGrownPage; a job with a
// webhook rule keeps SPIEGEL_CHANGES_BATCH; a short page does not change the size, and large docs
// keep it where it is.
func TestPagesGrowForOutputRules(t *testing.T) {
	t.Parallel()
	rule := func(doc string) *rules.OnChange {
		r, err := rules.Parse("r", []byte(doc))
		require.NoError(t, err)
		return r.(*rules.OnChange)
	}
	subject := rule(`{"type":"on_change","subject":"chg.${db_name}"}`)
	mirror := rule(`{"type":"on_change","mirror":"M"}`)
	hook := rule(`{"type":"on_change","url":"http://127.0.0.1:9/x"}`)
	page := func(n, docBytes int) couch.ChangesPage {
		p := couch.ChangesPage{Results: make([]couch.Change, n)}
		for i := range p.Results {
			p.Results[i].Doc = []byte(strings.Repeat("x", docBytes))
		}
		return p
	}
	h := &handler{batchSize: 100}

	s := h.pageSizer([]*rules.OnChange{subject, mirror})
	assert.Equal(t, 100, s.next())
	s.read(100, page(100, 200))
	assert.Equal(t, maxGrownPage, s.next(), "small docs: the largest page")

	s = h.pageSizer([]*rules.OnChange{mirror})
	s.read(100, page(100, pageBytes/2/300))
	assert.Equal(t, 300, s.next(), "docs of a sixth of a MiB: 300 fit in half the budget")

	s = h.pageSizer([]*rules.OnChange{subject, hook})
	s.read(100, page(100, 200))
	assert.Equal(t, 100, s.next(), "a job with a webhook rule keeps its pages")

	s = h.pageSizer([]*rules.OnChange{mirror})
	s.read(100, page(99, 200))
	assert.Equal(t, 100, s.next(), "a short page leaves the size")
	s.read(100, page(100, pageBytes/100))
	assert.Equal(t, 100, s.next(), "large docs keep the size")

	h = &handler{batchSize: 5000}
	assert.Equal(t, 5000, h.pageSizer([]*rules.OnChange{subject}).next(), "a larger SPIEGEL_CHANGES_BATCH is kept")
}
