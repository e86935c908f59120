package replicate

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// testLog returns a logger that writes warnings and above to the test log.
func testLog(t testing.TB) logrus.FieldLogger {
	l := logrus.New()
	l.SetOutput(tWriter{t})
	l.SetLevel(logrus.WarnLevel)
	return l
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// dbURL returns the full URL of db on the test server (with its credentials, if any).
func dbURL(s *couchtest.Server, db string) string {
	return s.URL + "/" + url.PathEscape(db)
}

// raw sends a request to the test server and returns the status and body.
func raw(t testing.TB, s *couchtest.Server, method, path string, body any, accept string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		require.NoError(t, err)
		rd = bytes.NewReader(data)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, s.URL+path, rd)
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", accept)
	resp, err := s.HTTP.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, data
}

// bulkDocsNoEdits writes docs with new_edits=false.
func bulkDocsNoEdits(t testing.TB, s *couchtest.Server, db string, docs []map[string]any) {
	t.Helper()
	st, body := raw(t, s, http.MethodPost, "/"+url.PathEscape(db)+"/_bulk_docs",
		map[string]any{"new_edits": false, "docs": docs}, "application/json")
	require.Less(t, st, 300, string(body))
}

// createDocs writes n small docs id prefix+i through _bulk_docs in chunks.
func createDocs(t testing.TB, s *couchtest.Server, db, prefix string, n int) {
	t.Helper()
	for start := 0; start < n; start += 2000 {
		var docs []map[string]any
		for i := start; i < min(n, start+2000); i++ {
			docs = append(docs, map[string]any{"_id": fmt.Sprintf("%s%06d", prefix, i), "n": i, "v": "small"})
		}
		st, body := raw(t, s, http.MethodPost, "/"+url.PathEscape(db)+"/_bulk_docs", map[string]any{"docs": docs}, "application/json")
		require.Less(t, st, 300, string(body))
	}
}

// docCount returns the doc_count of db.
func docCount(t testing.TB, s *couchtest.Server, db string) int {
	t.Helper()
	var info struct {
		DocCount int `json:"doc_count"`
	}
	require.NoError(t, s.Do(t, http.MethodGet, "/"+url.PathEscape(db), nil, &info))
	return info.DocCount
}

// leaf is one leaf revision of a doc as the server returns it: rev, deletion, body without
// _revisions, attachment digests.
type leaf struct {
	Rev     string
	Deleted bool
	Body    string
}

// leaves returns, for every doc of db (deleted ones too), its leaf revisions sorted by rev,
// read with GET ?open_revs=all (Accept: application/json).
func leaves(t testing.TB, s *couchtest.Server, db string) map[string][]leaf {
	t.Helper()
	var ch struct {
		Results []struct {
			ID string `json:"id"`
		} `json:"results"`
	}
	st, body := raw(t, s, http.MethodGet, "/"+url.PathEscape(db)+"/_changes?style=all_docs", nil, "application/json")
	require.Equal(t, http.StatusOK, st, string(body))
	require.NoError(t, json.Unmarshal(body, &ch))
	out := map[string][]leaf{}
	for _, r := range ch.Results {
		st, body := raw(t, s, http.MethodGet, "/"+url.PathEscape(db)+"/"+url.PathEscape(r.ID)+"?open_revs=all", nil, "application/json")
		require.Equal(t, http.StatusOK, st, string(body))
		var revs []struct {
			OK map[string]any `json:"ok"`
		}
		require.NoError(t, json.Unmarshal(body, &revs))
		var ls []leaf
		for _, rv := range revs {
			if rv.OK == nil {
				continue
			}
			l := leaf{Rev: rv.OK["_rev"].(string), Deleted: rv.OK["_deleted"] == true}
			delete(rv.OK, "_revisions")
			if atts, ok := rv.OK["_attachments"].(map[string]any); ok {
				digests := map[string]any{}
				for name, a := range atts {
					digests[name] = a.(map[string]any)["digest"]
				}
				rv.OK["_attachments"] = digests
			}
			data, err := json.Marshal(rv.OK)
			require.NoError(t, err)
			l.Body = string(data)
			ls = append(ls, l)
		}
		sort.Slice(ls, func(i, j int) bool { return ls[i].Rev < ls[j].Rev })
		out[r.ID] = ls
	}
	return out
}

// requireSameLeaves fails unless target holds exactly the source's leaves for every doc.
func requireSameLeaves(t testing.TB, s *couchtest.Server, source, target string) {
	t.Helper()
	src, tgt := leaves(t, s, source), leaves(t, s, target)
	srcIDs, tgtIDs := keys(src), keys(tgt)
	require.Equal(t, srcIDs, tgtIDs, "doc ids")
	for _, id := range srcIDs {
		require.Equal(t, src[id], tgt[id], "leaves of %s", id)
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
