package couch

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/go-kivik/kivik/v4"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// BenchmarkKivikVersusRaw measures, on the test server, the requests of the native engine and
// the checkpoint store done through kivik and through this package's raw JSON calls, to choose
// between them: db info, _revs_diff and _bulk_get of 100 revisions, _bulk_docs of 100 docs with
// new_edits=false, and a _local doc read and write. Run: go test -run x -bench KivikVersusRaw
// ./pkg/couch (with COUCHDB_URL).
func BenchmarkKivikVersusRaw(b *testing.B) {
	srv := couchtest.Get(b)
	c, err := New(Config{URL: srv.URL}, nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	db := srv.NewDB(b, "kivikbench_")
	kdb := c.Kivik().DB(db)
	const n = 100
	docs := make([]map[string]any, n)
	revs := map[string][]string{}
	var refs []kivik.BulkGetReference
	var rawRefs []map[string]string
	for i := range docs {
		id := fmt.Sprintf("doc%03d", i)
		rev := fmt.Sprintf("1-%032x", i)
		docs[i] = map[string]any{"_id": id, "_rev": rev, "n": i, "text": "some payload text of a user document"}
		revs[id] = []string{rev}
		refs = append(refs, kivik.BulkGetReference{ID: id, Rev: rev})
		rawRefs = append(rawRefs, map[string]string{"id": id, "rev": rev})
	}
	if err := c.DoIdempotent(ctx, http.MethodPost, c.DBPath(db)+"/_bulk_docs", nil, map[string]any{"docs": docs, "new_edits": false}, nil); err != nil {
		b.Fatal(err)
	}
	missing := map[string][]string{}
	for id := range revs {
		missing[id] = []string{"2-" + id}
	}
	local := "_local/bench"
	if err := c.Do(ctx, http.MethodPut, c.DBPath(db)+"/"+local, nil, map[string]any{"x": 1}, nil); err != nil {
		b.Fatal(err)
	}

	cases := []struct {
		name       string
		kivik, raw func() error
	}{
		{"db info", func() error { _, err := kdb.Stats(ctx); return err }, func() error { _, err := c.DBInfo(ctx, db); return err }},
		{"revs_diff 100", func() error {
			rows := kdb.RevsDiff(ctx, missing)
			defer rows.Close()
			for rows.Next() {
				var d struct {
					Missing []string `json:"missing"`
				}
				if err := rows.ScanValue(&d); err != nil {
					return err
				}
			}
			return rows.Err()
		}, func() error {
			var out map[string]struct {
				Missing []string `json:"missing"`
			}
			return c.DoIdempotent(ctx, http.MethodPost, c.DBPath(db)+"/_revs_diff", nil, missing, &out)
		}},
		{"bulk_get 100", func() error {
			rows := kdb.BulkGet(ctx, refs, kivik.Param("revs", true))
			defer rows.Close()
			for rows.Next() {
				var d map[string]any
				if err := rows.ScanDoc(&d); err != nil {
					return err
				}
			}
			return rows.Err()
		}, func() error {
			var out struct {
				Results []struct {
					Docs []map[string]any `json:"docs"`
				} `json:"results"`
			}
			return c.DoIdempotent(ctx, http.MethodPost, c.DBPath(db)+"/_bulk_get", map[string][]string{"revs": {"true"}}, map[string]any{"docs": rawRefs}, &out)
		}},
		{"bulk_docs 100 new_edits=false", func() error {
			any := make([]any, len(docs))
			for i := range docs {
				any[i] = docs[i]
			}
			_, err := kdb.BulkDocs(ctx, any, kivik.Param("new_edits", false))
			return err
		}, func() error {
			return c.DoIdempotent(ctx, http.MethodPost, c.DBPath(db)+"/_bulk_docs", nil, map[string]any{"docs": docs, "new_edits": false}, nil)
		}},
		{"_local get", func() error {
			var d map[string]any
			return kdb.Get(ctx, local).ScanDoc(&d)
		}, func() error {
			var d map[string]any
			return c.Do(ctx, http.MethodGet, c.DBPath(db)+"/"+local, nil, nil, &d)
		}},
	}
	for _, tc := range cases {
		for _, impl := range []struct {
			name string
			fn   func() error
		}{{"kivik", tc.kivik}, {"raw", tc.raw}} {
			b.Run(tc.name+"/"+impl.name, func(b *testing.B) {
				for b.Loop() {
					if err := impl.fn(); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
