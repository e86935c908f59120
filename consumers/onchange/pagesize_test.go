package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// TestPagesGrowForOutputRules: a job whose rules all publish or mirror reads pages that double
// while they come full, up to maxGrownPage; a job with a webhook rule keeps SPIEGEL_CHANGES_BATCH;
// a page of large docs stops the growth, and a short page does not change it.
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
	var got []int
	for range 6 {
		n := s.next()
		got = append(got, n)
		s.read(n, page(n, 200))
	}
	assert.Equal(t, []int{100, 200, 400, 800, 1000, 1000}, got)

	s = h.pageSizer([]*rules.OnChange{subject, hook})
	s.read(100, page(100, 200))
	assert.Equal(t, 100, s.next(), "a job with a webhook rule keeps its pages")

	s = h.pageSizer([]*rules.OnChange{mirror})
	s.read(100, page(99, 200))
	assert.Equal(t, 100, s.next(), "a short page leaves the size")
	s.read(100, page(100, pageBytes/100))
	assert.Equal(t, 100, s.next(), "large docs stop the growth")

	h = &handler{batchSize: 5000}
	assert.Equal(t, 5000, h.pageSizer([]*rules.OnChange{subject}).next(), "a larger SPIEGEL_CHANGES_BATCH is kept")
}
