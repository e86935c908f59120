package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// streamsDocID is the id of a workload db's i-th doc.
func streamsDocID(i int) string { return fmt.Sprintf("d%07d", i) }

// streamsDoc is a workload db's i-th doc: about 200 bytes of JSON with its _id and _rev.
func streamsDoc(i int) map[string]any {
	return map[string]any{"_id": streamsDocID(i), "n": i,
		"text": fmt.Sprintf("doc %07d of the change-streams benchmark: a small body, as most docs of a db per user are, with a little text", i)}
}

// ensureStreamsDBs makes the workload's dbs hold exactly its docs: a db that already does (a
// previous run's) is kept as it is, any other is deleted and loaded again. A db that the rules'
// pattern matches but is not one of the workload's (left by a run of another version) is
// deleted: the rules must match the workload's dbs alone. It returns what it did.
func ensureStreamsDBs(b *testing.B, cs *couchtest.Server, w streamsWorkload) string {
	b.Helper()
	var all []string
	if err := cs.Do(b, http.MethodGet, "/_all_dbs", nil, &all); err != nil {
		b.Fatalf("list dbs: %v", err)
	}
	re := regexp.MustCompile(w.pattern())
	want := map[string]bool{}
	for i := range w.dbs {
		want[w.dbName(i)] = true
	}
	for _, db := range all {
		if re.MatchString(db) && !want[db] {
			b.Logf("deleting %s: the workload's rules would match it", db)
			if err := cs.Do(b, http.MethodDelete, "/"+couchtest.PathDB(db), nil, nil); err != nil {
				b.Fatalf("delete %s: %v", db, err)
			}
		}
	}
	start := time.Now()
	reused, loaded := 0, 0
	for i := range w.dbs {
		db := w.dbName(i)
		if streamsDBHolds(b, cs, db, w.docs) {
			reused++
			continue
		}
		_ = cs.Do(b, http.MethodDelete, "/"+couchtest.PathDB(db), nil, nil) // 404 when it does not exist
		if err := cs.Do(b, http.MethodPut, "/"+couchtest.PathDB(db), nil, nil); err != nil {
			b.Fatalf("create %s: %v", db, err)
		}
		const batch = 2000
		for from := 0; from < w.docs; from += batch {
			docs := make([]map[string]any, 0, batch)
			for j := from; j < min(from+batch, w.docs); j++ {
				docs = append(docs, streamsDoc(j))
			}
			var rows []struct {
				ID    string `json:"id"`
				Error string `json:"error"`
			}
			if err := cs.Do(b, http.MethodPost, "/"+couchtest.PathDB(db)+"/_bulk_docs", map[string]any{"docs": docs}, &rows); err != nil {
				b.Fatalf("load %s: %v", db, err)
			}
			for _, r := range rows {
				if r.Error != "" {
					b.Fatalf("load %s: doc %s: %s", db, r.ID, r.Error)
				}
			}
		}
		if !streamsDBHolds(b, cs, db, w.docs) {
			b.Fatalf("%s does not hold its %d docs after loading them", db, w.docs)
		}
		loaded++
	}
	if loaded == 0 {
		return fmt.Sprintf("%s reused", w)
	}
	return fmt.Sprintf("%s loaded in %.1f s (%d of its %d dbs; the others reused)", w, time.Since(start).Seconds(), loaded, w.dbs)
}

// streamsDBHolds reports whether db exists and holds exactly docs docs, none deleted, the first
// and the last of them among them.
func streamsDBHolds(b *testing.B, cs *couchtest.Server, db string, docs int) bool {
	b.Helper()
	var info struct {
		DocCount    int `json:"doc_count"`
		DocDelCount int `json:"doc_del_count"`
	}
	if err := cs.Do(b, http.MethodGet, "/"+couchtest.PathDB(db), nil, &info); err != nil {
		return false
	}
	if info.DocCount != docs || info.DocDelCount != 0 {
		return false
	}
	var all struct {
		Rows []struct {
			ID    string `json:"id"`
			Error string `json:"error"`
		} `json:"rows"`
	}
	keys := []string{streamsDocID(0), streamsDocID(docs - 1)}
	if err := cs.Do(b, http.MethodPost, "/"+couchtest.PathDB(db)+"/_all_docs", map[string]any{"keys": keys}, &all); err != nil || len(all.Rows) != 2 {
		return false
	}
	for i, r := range all.Rows {
		if r.Error != "" || r.ID != keys[i] {
			return false
		}
	}
	return true
}

// changesPage is one page of GET /{db}/_changes.
type changesPage struct {
	Results []changeRow     `json:"results"`
	LastSeq json.RawMessage `json:"last_seq"`
	Pending *int64          `json:"pending"` // CouchDB 2+; PouchDB Server leaves it out
}

// changeRow is one change of a page, as the loop publishes it (with the db's name).
type changeRow struct {
	Seq     json.RawMessage `json:"seq"`
	ID      string          `json:"id"`
	Changes []struct {
		Rev string `json:"rev"`
	} `json:"changes"`
	Deleted bool            `json:"deleted,omitempty"`
	Doc     json.RawMessage `json:"doc,omitempty"`
}

// readChangesPage reads up to limit changes of db since since, with their docs.
func readChangesPage(ctx context.Context, cs *couchtest.Server, db, since string, limit int) (changesPage, error) {
	var page changesPage
	u := cs.URL + "/" + couchtest.PathDB(db) + "/_changes?include_docs=true&limit=" + strconv.Itoa(limit) + "&since=" + url.QueryEscape(since)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return page, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := cs.HTTP.Do(req)
	if err != nil {
		return page, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return page, fmt.Errorf("GET /%s/_changes: %s: %s", db, resp.Status, bytes.TrimSpace(body))
	}
	if err := json.NewDecoder(resp.Body).Decode(&page); err != nil {
		return page, fmt.Errorf("GET /%s/_changes: %w", db, err)
	}
	return page, nil
}

// seqString is a seq as a since parameter: CouchDB's are strings, PouchDB Server's numbers.
func seqString(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return strings.TrimSpace(string(raw))
}

// forgetIdentity deletes each workload db's identity doc (_local/<checkpoint.IdentityID>), which
// the first on_change rule to begin in a db writes and `producer uninstall` leaves, so that every
// rule variant meets the dbs as the first rule in them does.
func forgetIdentity(b *testing.B, cs *couchtest.Server, w streamsWorkload) {
	b.Helper()
	for i := range w.dbs {
		path := "/" + couchtest.PathDB(w.dbName(i)) + "/_local/" + checkpoint.IdentityID
		var doc struct {
			Rev string `json:"_rev"`
		}
		if err := cs.Do(b, http.MethodGet, path, nil, &doc); err != nil {
			if strings.Contains(err.Error(), "404") {
				continue
			}
			b.Fatalf("read %s: %v", path, err)
		}
		if err := cs.Do(b, http.MethodDelete, path+"?rev="+url.QueryEscape(doc.Rev), nil, nil); err != nil {
			b.Fatalf("delete %s: %v", path, err)
		}
	}
}
