package replicate

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// mutator makes random histories on a db: creates (some with attachments), updates, deletes
// through the server, and conflicts (a sibling of the winning rev, sometimes deleted) through
// _bulk_docs with new_edits=false and made-up revs.
type mutator struct {
	t   *testing.T
	s   *couchtest.Server
	db  string
	rng *rand.Rand
	ids []string
}

func (m *mutator) path(id string) string {
	return "/" + url.PathEscape(m.db) + "/" + url.PathEscape(id)
}

func (m *mutator) hex() string {
	return fmt.Sprintf("%016x%016x", m.rng.Uint64(), m.rng.Uint64())
}

func (m *mutator) attachment() map[string]any {
	data := make([]byte, 1+m.rng.IntN(300))
	for i := range data {
		data[i] = byte(m.rng.IntN(256))
	}
	return map[string]any{"content_type": "application/octet-stream", "data": base64.StdEncoding.EncodeToString(data)}
}

// current returns the winning revision of id with its _revisions, or nil if missing/deleted.
func (m *mutator) current(id string) map[string]any {
	st, body := raw(m.t, m.s, http.MethodGet, m.path(id)+"?revs=true", nil, "application/json")
	if st == http.StatusNotFound {
		return nil
	}
	require.Equal(m.t, http.StatusOK, st, string(body))
	var doc map[string]any
	require.NoError(m.t, json.Unmarshal(body, &doc))
	return doc
}

func (m *mutator) step() {
	if len(m.ids) == 0 || m.rng.IntN(4) == 0 {
		id := fmt.Sprintf("doc-%03d", len(m.ids))
		m.ids = append(m.ids, id)
		doc := map[string]any{"n": m.rng.IntN(1000)}
		if m.rng.IntN(3) == 0 {
			doc["_attachments"] = map[string]any{"a.bin": m.attachment()}
		}
		st, body := raw(m.t, m.s, http.MethodPut, m.path(id), doc, "application/json")
		require.Less(m.t, st, 300, string(body))
		return
	}
	id := m.ids[m.rng.IntN(len(m.ids))]
	cur := m.current(id)
	if cur == nil {
		return // deleted: leave it (its tombstone must replicate)
	}
	switch op := m.rng.IntN(10); {
	case op < 5: // update, sometimes adding an attachment
		cur["n"] = m.rng.IntN(1000)
		delete(cur, "_revisions")
		if m.rng.IntN(3) == 0 {
			atts, _ := cur["_attachments"].(map[string]any)
			if atts == nil {
				atts = map[string]any{}
			}
			atts[fmt.Sprintf("u%d.bin", m.rng.IntN(3))] = m.attachment()
			cur["_attachments"] = atts
		}
		st, body := raw(m.t, m.s, http.MethodPut, m.path(id), cur, "application/json")
		require.Less(m.t, st, 300, string(body))
	case op < 7: // delete
		st, body := raw(m.t, m.s, http.MethodDelete, m.path(id)+"?rev="+url.QueryEscape(cur["_rev"].(string)), nil, "application/json")
		require.Less(m.t, st, 300, string(body))
	default: // conflict: a sibling of the winner
		revs := cur["_revisions"].(map[string]any)
		start := int(revs["start"].(float64))
		var ids []any
		ids = append(ids, m.hex())
		ids = append(ids, revs["ids"].([]any)[1:]...)
		doc := map[string]any{
			"_id": id, "_rev": fmt.Sprintf("%d-%s", start, ids[0]),
			"_revisions": map[string]any{"start": start, "ids": ids},
			"conflict":   true, "n": m.rng.IntN(1000),
		}
		if m.rng.IntN(4) == 0 {
			doc["_deleted"] = true
		}
		if m.rng.IntN(3) == 0 {
			doc["_attachments"] = map[string]any{"c.bin": m.attachment()}
		}
		bulkDocsNoEdits(m.t, m.s, m.db, []map[string]any{doc})
	}
}

// TestPropertyLeavesMatch: random histories, replicated in several incremental rounds with
// small batches and parallel workers; after every round the target's leaves equal the
// source's, for every doc.
func TestPropertyLeavesMatch(t *testing.T) {
	s := couchtest.Get(t)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for run := range 2 {
		t.Run(fmt.Sprintf("run%d", run), func(t *testing.T) {
			source, target := s.NewDB(t, "rsrc_"), s.NewDB(t, "rtgt_")
			m := &mutator{t: t, s: s, db: source, rng: rand.New(rand.NewPCG(seed, uint64(run)))}
			opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), BatchSize: 1 + m.rng.IntN(15), Workers: 1 + m.rng.IntN(4)}
			for round := range 4 {
				for range 30 + m.rng.IntN(40) {
					m.step()
				}
				res, err := Run(t.Context(), opt, testLog(t))
				require.NoError(t, err, "round %d", round)
				assert.True(t, res.OK)
				assert.Zero(t, res.DocWriteFailures)
				assert.Equal(t, res.DocsRead, res.DocsWritten)
				if round > 0 {
					assert.NotEmpty(t, res.StartSeq, "round %d resumes from a checkpoint", round)
				}
				requireSameLeaves(t, s, source, target)
			}
			res, err := Run(t.Context(), opt, testLog(t))
			require.NoError(t, err)
			assert.True(t, res.NoChanges)
			// The histories exercised what matters: conflicts, deletions, attachments.
			var conflicted, deleted, withAtts int
			for _, ls := range leaves(t, s, source) {
				if len(ls) > 1 {
					conflicted++
				}
				for _, l := range ls {
					if l.Deleted {
						deleted++
					}
					if strings.Contains(l.Body, `"_attachments"`) {
						withAtts++
					}
				}
			}
			t.Logf("conflicted docs %d, deleted leaves %d, leaves with attachments %d", conflicted, deleted, withAtts)
			assert.Positive(t, conflicted)
			assert.Positive(t, deleted)
			assert.Positive(t, withAtts)
		})
	}
}
