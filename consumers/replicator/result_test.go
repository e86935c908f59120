package main

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// fixture returns the status and body of the exchange name recorded in the fixture set set
// (couchtest.FixtureSets).
func fixture(t *testing.T, set, name string) (int, []byte) {
	t.Helper()
	rec := couchtest.FixtureFrom(t, set, name)
	return rec.Status, rec.Body
}

func TestParseResultCouchDBFixtures(t *testing.T) {
	t.Parallel()
	cases := []struct {
		file      string
		written   int64
		noChanges bool
	}{
		{"replicate-oneshot.http", 4, false},
		{"replicate-no-changes.http", 0, true},
		{"replicate-create-target.http", 4, false},
		{"replicate-selector.http", 2, false},
	}
	for _, set := range couchtest.FixtureSets() {
		for _, c := range cases {
			t.Run(set+"/"+c.file, func(t *testing.T) {
				t.Parallel()
				status, body := fixture(t, set, c.file)
				require.Equal(t, 200, status)
				res, err := parseResult(body)
				require.NoError(t, err)
				assert.Equal(t, c.written, res.DocsWritten)
				assert.Equal(t, c.noChanges, res.NoChanges)
				assert.NotEmpty(t, res.SessionID)
			})
		}
	}
}

func TestParseResultPouchDBAndBadAnswers(t *testing.T) {
	t.Parallel()
	pouch := `{"ok":true,"start_time":"2026-11-22T05:09:07.483Z","docs_read":3,"docs_written":3,"doc_write_failures":1,"errors":[],"last_seq":1,"status":"complete","history":[{"docs_written":99}]}`
	res, err := parseResult([]byte(pouch))
	require.NoError(t, err)
	assert.Equal(t, int64(3), res.DocsWritten)
	assert.Equal(t, int64(1), res.DocWriteFailures)

	for _, bad := range []string{`{"ok":false}`, `{}`, `<html>`, `{"ok":true,"status":"aborted","docs_written":1}`} {
		_, err := parseResult([]byte(bad))
		assert.Error(t, err, bad)
	}
}

func TestErrorFixturesClassify(t *testing.T) {
	t.Parallel()
	cases := []struct {
		file string
		want failureKind
	}{
		{"replicate-bad-auth.http", permanent},
		{"replicate-missing-source.http", dbNotFound},
		{"replicate-missing-target.http", dbNotFound},
	}
	for _, set := range couchtest.FixtureSets() {
		for _, c := range cases {
			t.Run(set+"/"+c.file, func(t *testing.T) {
				t.Parallel()
				status, body := fixture(t, set, c.file)
				err := replicateAnswer(t, status, body, []string{"PASS"})
				assert.Equal(t, c.want, classify(err))
				var re *replicateError
				require.ErrorAs(t, err, &re)
				assert.NotEmpty(t, re.ErrorName)
			})
		}
	}
}

// replicateAnswer runs the couchdb engine against a server that answers POST /_replicate with
// status and body, and returns its error.
func replicateAnswer(t *testing.T, status int, body []byte, secrets []string) error {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}))
	t.Cleanup(srv.Close)
	c, err := couch.New(couch.Config{URL: srv.URL}, nil)
	require.NoError(t, err)
	_, err = couchEngine{server: c}.Replicate(t.Context(), map[string]any{"source": "a", "target": "b"}, secrets)
	return err
}

func FuzzParseResult(f *testing.F) {
	f.Add([]byte(`{"ok":true,"no_changes":true}`))
	f.Add([]byte(`{"ok":true,"session_id":"a","history":[{"session_id":"a","docs_written":4}]}`))
	f.Add([]byte(`{"ok":true,"docs_written":-3,"status":"complete"}`))
	for _, set := range []string{couchtest.CouchDB35, couchtest.CouchDB35Cluster} {
		for _, name := range []string{"replicate-oneshot", "replicate-no-changes", "replicate-selector", "replicate-bad-auth"} {
			f.Add(couchtest.FixtureFrom(f, set, name).Body)
		}
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		res, err := parseResult(body)
		if err == nil && (res.DocsWritten < 0 || res.DocWriteFailures < 0) {
			t.Fatalf("negative count from %q", body)
		}
	})
}

// TestParseResultCumulativeCounts: CouchDB 3 carries the counts of earlier sessions over into
// history[0]; the run's own counts are the difference with history[1] (answer recorded from
// CouchDB 3.3.3: a first run wrote 3 docs, this second one 1).
func TestParseResultCumulativeCounts(t *testing.T) {
	t.Parallel()
	body := []byte(`{"ok":true,"session_id":"34f487835a43a25e21b810340a9a4575","source_last_seq":"4-g1AAAA","replication_id_version":4,
		"history":[{"session_id":"34f487835a43a25e21b810340a9a4575","start_last_seq":"3-g1AAAA","end_last_seq":"4-g1AAAA","recorded_seq":"4-g1AAAA",
		"missing_checked":4,"missing_found":4,"docs_read":4,"docs_written":4,"doc_write_failures":1},
		{"session_id":"1418e29792b54c1dfee8e14018ed4697","start_last_seq":0,"end_last_seq":"3-g1AAAA","recorded_seq":"3-g1AAAA",
		"missing_checked":3,"missing_found":3,"docs_read":3,"docs_written":3,"doc_write_failures":0}]}`)
	res, err := parseResult(body)
	require.NoError(t, err)
	assert.Equal(t, int64(1), res.DocsWritten)
	assert.Equal(t, int64(1), res.DocWriteFailures)

	// Without a replication id version (an older server: per-session counts) history[0] is taken
	// as it is.
	res, err = parseResult(bytes.Replace(body, []byte(`"replication_id_version":4,`), nil, 1))
	require.NoError(t, err)
	assert.Equal(t, int64(4), res.DocsWritten)
}
