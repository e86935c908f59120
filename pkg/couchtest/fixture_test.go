package couchtest

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fixtureNames are the exchanges every fixture set holds under the same name.
var fixtureNames = []string{
	"all-dbs", "bulk-docs-new-edits-false", "bulk-get", "changes-continuous", "changes-limit",
	"changes-longpoll-empty", "changes-normal", "changes-since-last", "changes-with-deletion",
	"db-updates-after-delete", "db-updates-continuous-live", "db-updates-continuous", "db-updates-limit",
	"db-updates-longpoll", "db-updates-normal", "dbs-info", "delete-db", "get-db-missing", "get-db",
	"get-doc-conflicts", "get-local", "global-changes", "open-revs-all", "put-db-exists",
	"put-db-invalid-name", "put-db", "put-ddoc-validate", "put-doc-conflict", "put-doc-forbidden",
	"put-doc", "put-local", "replicate-bad-auth", "replicate-create-target", "replicate-missing-source",
	"replicate-missing-target", "replicate-no-changes", "replicate-oneshot", "replicate-selector",
	"revs-diff", "root", "unauthorized",
}

func TestFixtureSetsHoldTheSameExchanges(t *testing.T) {
	t.Parallel()
	for _, set := range FixtureSets() {
		t.Run(set, func(t *testing.T) {
			t.Parallel()
			for _, name := range fixtureNames {
				rec := FixtureFrom(t, set, name)
				assert.NotEmpty(t, rec.Request, name)
				assert.NotZero(t, rec.Status, name)
			}
			root := FixtureFrom(t, set, "root")
			version := map[string]string{CouchDB33: `"version":"3.3.3"`, CouchDB35: `"version":"3.5.2"`, CouchDB35Cluster: `"version":"3.5.2"`}[set]
			assert.Contains(t, string(root.Body), version)
		})
	}
}

// userinfoRE finds the user:password@ of a URL.
var userinfoRE = regexp.MustCompile(`//([^/@\s"]*)@`)

// No recorded file holds a credential: URLs carry USER:PASS (or USER:WRONG, the refused one), no
// cookie is recorded and the _users docs' derived keys and salts are zeros.
func TestFixturesHoldNoCredentials(t *testing.T) {
	t.Parallel()
	for _, set := range []string{CouchDB35, CouchDB35Cluster} {
		files, err := filepath.Glob(filepath.Join(FixtureSetDir(t, set), "*.http"))
		require.NoError(t, err)
		require.NotEmpty(t, files)
		for _, f := range files {
			data, err := os.ReadFile(f)
			require.NoError(t, err)
			text := string(data)
			for _, m := range userinfoRE.FindAllStringSubmatch(text, -1) {
				assert.Contains(t, []string{"USER:PASS", "USER:WRONG"}, m[1], f)
			}
			assert.NotContains(t, strings.ToLower(text), "set-cookie", f)
			assert.NotContains(t, text, "AuthSession", f)
			for _, m := range regexp.MustCompile(`"(?:derived_key|salt)":"([^"]*)"`).FindAllStringSubmatch(text, -1) {
				assert.Equal(t, strings.Repeat("0", len(m[1])), m[1], f)
			}
		}
	}
}

func TestParseRecorded(t *testing.T) {
	t.Parallel()
	rec, err := ParseRecorded([]byte("> GET /x\n> {\"a\":1}\n< HTTP/1.1 404 Object Not Found\n< Content-Type: application/json\n\n{\"error\":\"not_found\"}\n\n"))
	require.NoError(t, err)
	assert.Equal(t, Recorded{Request: []string{"GET /x", `{"a":1}`}, Status: 404, ContentType: "application/json",
		Body: []byte("{\"error\":\"not_found\"}\n\n")}, rec)
	assert.Equal(t, [][]byte{[]byte(`{"error":"not_found"}`)}, rec.Lines())

	for _, bad := range []string{"", "> GET /\n", "> GET /\n\nbody", "> GET /\n< HTTP/1.1\n\n", "> GET /\n< HTTP/1.1 abc\n\n", "GET /\n< HTTP/1.1 200 OK\n\n"} {
		_, err := ParseRecorded([]byte(bad))
		assert.Error(t, err, "%q", bad)
	}
}

func FuzzParseRecorded(f *testing.F) {
	for _, name := range []string{"changes-normal", "open-revs-all", "unauthorized", "replicate-bad-auth"} {
		f.Add(FixtureFrom(f, CouchDB35, name).Request[0] + "\n")
		data, err := os.ReadFile(filepath.Join(FixtureSetDir(f, CouchDB35Cluster), name+".http"))
		require.NoError(f, err)
		f.Add(string(data))
	}
	f.Fuzz(func(t *testing.T, data string) {
		rec, err := ParseRecorded([]byte(data))
		if err != nil {
			return
		}
		if rec.Status < 100 || rec.Status > 599 || !strings.HasSuffix(data, string(rec.Body)) {
			t.Fatalf("bad record %+v of %q", rec, data)
		}
		for _, l := range rec.Lines() {
			if len(l) == 0 || strings.Contains(string(l), "\n") {
				t.Fatalf("bad line %q", l)
			}
		}
	})
}
