package replicate

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// Pages ask the server for one packed seq per page (seq_interval = the page size): a run reads
// only a page's last_seq. On CouchDB the rows after a page's first then come without a seq, and
// the run still replicates every page and checkpoints where the last one ended: the next run
// reads only what came after.
func TestPagesAskOneSeqPerPage(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "pgsrc_"), s.NewDB(t, "pgtgt_")
	createDocs(t, s, source, "a", 12)
	if !s.PouchDB {
		var page struct {
			Results []struct {
				Seq couch.Seq `json:"seq"`
			} `json:"results"`
			LastSeq couch.Seq `json:"last_seq"`
		}
		require.NoError(t, s.Do(t, "GET", "/"+couchtest.PathDB(source)+"/_changes?limit=5&seq_interval=5", nil, &page))
		require.Len(t, page.Results, 5)
		assert.NotEmpty(t, page.Results[0].Seq, "the page's first row has a seq")
		for i, r := range page.Results[1:] {
			assert.Empty(t, r.Seq, "row %d of the page has none", i+2)
		}
		assert.NotEmpty(t, page.LastSeq)
	}

	log := &requestLog{base: &http.Transport{DisableCompression: true}, queries: true}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), HTTPClient: &http.Client{Transport: log}, BatchSize: 5}
	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 12, res.DocsWritten)
	reqs := log.take()
	pages := 0
	for _, r := range reqs {
		if !strings.Contains(r, "/_changes") {
			continue
		}
		pages++
		_, rawQuery, _ := strings.Cut(strings.Fields(r)[1], "?")
		q, err := url.ParseQuery(rawQuery)
		require.NoError(t, err, r)
		assert.Equal(t, "5", q.Get("seq_interval"), "one seq per page of 5: %s", r)
	}
	assert.Equal(t, 3, pages, "12 docs in pages of 5: %v", reqs)
	requireSameLeaves(t, s, source, target)

	createDocs(t, s, source, "b", 3)
	res, err = Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 3, res.DocsRead, "the run starts where the last page ended")
	assert.EqualValues(t, 3, res.DocsWritten)
	requireSameLeaves(t, s, source, target)
}
