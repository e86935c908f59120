package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// writeFile writes a rule file into dir and returns its path.
func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

// runRulesCmd runs `producer rules args...` in-process with cfg and returns stdout, stderr and
// the error.
func runRulesCmd(t *testing.T, cfg config.Producer, args ...string) (string, string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := runRules(t.Context(), &cfg, discardLogger(), cmdIO{args: args, stdin: strings.NewReader(""), stdout: &out, stderr: &errOut})
	return out.String(), errOut.String(), err
}

// storedRule reads rule id straight from the spiegel db (nil when there is none).
func (e *env) storedRule(t *testing.T, id string) map[string]any {
	t.Helper()
	var doc map[string]any
	seg := couchtest.PathDB(id)
	if name, ok := strings.CutPrefix(id, "_design/"); ok {
		seg = "_design/" + couchtest.PathDB(name) // CouchDB reads _design%2F... as another db path
	}
	if err := e.Couch.Do(t, http.MethodGet, "/"+couchtest.PathDB(e.cfg.DBName)+"/"+seg, nil, &doc); err != nil {
		require.Contains(t, err.Error(), "404", "read %s", id)
		return nil
	}
	return doc
}

// apply creates, then updates what changed, then reports every rule unchanged; a dry run shows
// an update without writing it; _rev in a file is ignored.
func TestRulesApplyCreatesUpdatesAndLeavesAlone(t *testing.T) {
	e := newEnv(t)
	dir := t.TempDir()
	f := writeFile(t, dir, "rules.json", `[
	  {"_id": "backup", "type": "replicator", "source": "db1", "target": "db1_backup"},
	  {"_id": "hook", "type": "on_change", "db_name": "^user_", "url": "https://api.example/h/${db_name}", "method": "POST",
	   "timeout_ms": 1500.0, "retry": {"limit": 3}}]`)
	out := e.run(t, "rules", "apply", f)
	assert.Regexp(t, `(?m)^created\s+backup \(`, out)
	assert.Regexp(t, `(?m)^created\s+hook \(`, out)
	hook := e.storedRule(t, "hook")
	require.NotNil(t, hook)
	assert.Equal(t, "POST", hook["method"])
	assert.Equal(t, "db1_backup", e.storedRule(t, "backup")["target"])

	out = e.run(t, "rules", "apply", f)
	assert.Regexp(t, `(?m)^unchanged\s+backup \(`, out)
	assert.Regexp(t, `(?m)^unchanged\s+hook \(`, out)
	assert.Equal(t, hook["_rev"], e.storedRule(t, "hook")["_rev"], "an unchanged rule is not written")

	// An edit, and a _rev from an old `get --json`, which apply ignores.
	writeFile(t, dir, "rules.json", `[
	  {"_id": "backup", "_rev": "1-00000000000000000000000000000000", "type": "replicator", "source": "db1", "target": "db1_backup"},
	  {"_id": "hook", "type": "on_change", "db_name": "^user_", "url": "https://api.example/h/${db_name}", "method": "PUT",
	   "retry": {"limit": 3}}]`)
	out = e.run(t, "rules", "apply", "--dry-run", f)
	assert.Regexp(t, `(?m)^would be updated\s+hook \(.*\): method, timeout_ms$`, out)
	assert.Regexp(t, `(?m)^unchanged\s+backup`, out)
	assert.Equal(t, "POST", e.storedRule(t, "hook")["method"], "a dry run writes nothing")

	out = e.run(t, "rules", "apply", f, "--json") // flags after the files too
	var results []admin.ApplyResult
	require.NoError(t, json.Unmarshal([]byte(out), &results), out)
	require.Len(t, results, 2)
	assert.Equal(t, admin.ApplyResult{ID: "backup", File: f, Action: "unchanged", Rev: results[0].Rev}, results[0])
	assert.Equal(t, "updated", results[1].Action)
	assert.Equal(t, []string{"method", "timeout_ms"}, results[1].Changed)
	stored := e.storedRule(t, "hook")
	assert.Equal(t, results[1].Rev, stored["_rev"])
	assert.Equal(t, "PUT", stored["method"])
	assert.NotContains(t, stored, "timeout_ms")
}

// One invalid doc among several: nothing is written, and the error names the file, the rule and
// the field.
func TestRulesApplyInvalidWritesNothing(t *testing.T) {
	e := newEnv(t)
	dir := t.TempDir()
	good := writeFile(t, dir, "good.json", `[{"_id": "a", "type": "replicator", "source": "x", "target": "y"},
	  {"_id": "b", "type": "on_change", "subject": "orders.${db_name}"}]`)
	bad := writeFile(t, dir, "bad.json", `[{"_id": "c", "type": "on_change", "url": "https://api.example/x"},
	  {"_id": "d", "type": "on_change", "db_name": "user_(", "url": "https://api.example/x"}]`)
	noID := writeFile(t, dir, "noid.json", `{"type": "replicator", "source": "x", "target": "y"}`)

	_, stderr, err := runRulesCmd(t, e.cfg, "apply", good, bad)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "1 of 4 rule docs invalid: nothing was written")
	assert.Contains(t, stderr, bad+`: rule "d": field "db_name": invalid regular expression`)
	for _, id := range []string{"a", "b", "c", "d"} {
		assert.Nil(t, e.storedRule(t, id), "rule %s was written", id)
	}

	_, stderr, err = runRulesCmd(t, e.cfg, "apply", good, noID)
	require.Error(t, err)
	assert.Contains(t, stderr, noID+`: field "_id": required`)
	assert.Nil(t, e.storedRule(t, "a"))
}

// A concurrent edit between apply's read and its write (CouchDB answers 409): apply reads the
// doc again and writes over it.
func TestRulesApplyRetriesAConflict(t *testing.T) {
	e := newEnv(t)
	e.putRule(t, "race", map[string]any{"type": "replicator", "source": "x", "target": "old"})
	target, err := url.Parse(e.cfg.CouchDBURL)
	require.NoError(t, err)
	var puts, edits atomic.Int32
	editErr := make(chan error, 1)
	path := "/" + couchtest.PathDB(e.cfg.DBName) + "/race"
	rp := httputil.NewSingleHostReverseProxy(target)
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPut && strings.HasSuffix(r.URL.Path, "/race") && puts.Add(1) == 1 {
			// Another writer gets in first: the PUT below carries a stale _rev.
			var cur map[string]any
			err := e.Couch.Do(t, http.MethodGet, path, nil, &cur)
			if err == nil {
				err = e.Couch.Do(t, http.MethodPut, path, map[string]any{"_rev": cur["_rev"], "type": "replicator", "source": "x", "target": "concurrent"}, nil)
			}
			if err == nil {
				edits.Add(1)
			}
			editErr <- err
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(proxy.Close)
	cfg := e.cfg
	pu, err := url.Parse(proxy.URL)
	require.NoError(t, err)
	pu.User = target.User
	cfg.CouchDBURL = pu.String()

	f := writeFile(t, t.TempDir(), "race.json", `{"_id": "race", "type": "replicator", "source": "x", "target": "mine"}`)
	out, stderr, err := runRulesCmd(t, cfg, "apply", f)
	require.NoError(t, err, stderr)
	require.NoError(t, <-editErr, "the concurrent edit")
	assert.Regexp(t, `(?m)^updated\s+race \(.*\): target$`, out)
	assert.Equal(t, int32(1), edits.Load())
	assert.Equal(t, int32(2), puts.Load(), "one PUT refused with 409, one after reading again")
	assert.Equal(t, "mine", e.storedRule(t, "race")["target"])
}

// get prints what apply takes back; delete removes the rule; list shows it meanwhile; missing
// rules are errors naming the id.
func TestRulesGetListDeleteRoundTrip(t *testing.T) {
	e := newEnv(t)
	dir := t.TempDir()
	f := writeFile(t, dir, "r.json", `[{"_id": "r1", "type": "replicator", "db_name": "^user_", "source": "$db_name",
	  "target": "https://bob@backup.example/${db_name}", "dirty_after_milliseconds": 250},
	  {"_id": "r2", "type": "on_change", "mirror": "docs", "disabled": true}]`)
	e.run(t, "rules", "apply", f)
	e.putRule(t, "spiegel_producer_seq", map[string]any{"last_seq": "1"}) // the service's own doc
	e.putRule(t, "legacy", map[string]any{"type": "change_listener"})     // the service ignores it

	got := e.run(t, "rules", "get", "r1")
	assert.NotContains(t, got, "_rev")
	assert.Contains(t, got, "\n  \"_id\": \"r1\"", "indented, with the id")
	back := writeFile(t, dir, "back.json", got)
	assert.Regexp(t, `(?m)^unchanged\s+r1`, e.run(t, "rules", "apply", back))
	var compact map[string]any
	require.NoError(t, json.Unmarshal([]byte(e.run(t, "rules", "get", "--json", "r1")), &compact))
	assert.Equal(t, e.storedRule(t, "r1")["_rev"], compact["_rev"])

	var list []map[string]any
	require.NoError(t, json.Unmarshal([]byte(e.run(t, "rules", "list", "--json")), &list))
	require.Len(t, list, 3, "design doc and service docs aside: %v", list)
	assert.Equal(t, map[string]any{"id": "legacy", "kind": "change_listener", "enabled": true, "valid": false,
		"error": `rule "legacy": field "type": must be "replicator" or "on_change" (the service ignores any other doc)`}, list[0])
	assert.Equal(t, map[string]any{"id": "r1", "kind": "replicator", "enabled": true, "db_name": "^user_",
		"source": "$db_name", "target": "https://bob@backup.example/${db_name}", "valid": true}, list[1])
	assert.Equal(t, map[string]any{"id": "r2", "kind": "on_change", "enabled": false, "mirror": "docs", "valid": true}, list[2])
	text := e.run(t, "rules", "list")
	assert.Regexp(t, `(?m)^r1\s+replicator\s+true\s+\^user_\s+\$db_name → https://bob@backup.example/\$\{db_name\}\s+yes$`, text)
	assert.Regexp(t, `(?m)^r2\s+on_change\s+false\s+-\s+mirror docs\s+yes$`, text)

	var del map[string]any
	require.NoError(t, json.Unmarshal([]byte(e.run(t, "rules", "delete", "r2", "--json")), &del))
	assert.Equal(t, true, del["deleted"])
	assert.Nil(t, e.storedRule(t, "r2"))
	for _, cmd := range []string{"get", "delete"} {
		_, _, err := runRulesCmd(t, e.cfg, cmd, "r2")
		require.ErrorIs(t, err, admin.ErrRuleNotFound, cmd)
		assert.Contains(t, err.Error(), `rule "r2"`)
		assert.Equal(t, 1, realMainWith(t, e.cfg, "rules", cmd, "r2"), cmd)
	}
	_, _, err := runRulesCmd(t, e.cfg, "delete", "_design/spiegel")
	require.Error(t, err, "the service's own docs are not rules")
	assert.NotNil(t, e.storedRule(t, "_design/spiegel"))
}

// realMainWith runs the producer binary's main with cfg's CouchDB in the environment and returns
// its exit code.
func realMainWith(t *testing.T, cfg config.Producer, args ...string) int {
	t.Helper()
	t.Setenv("SPIEGEL_COUCHDB_URL", cfg.CouchDBURL)
	t.Setenv("SPIEGEL_DB_NAME", cfg.DBName)
	return realMain(t.Context(), args, strings.NewReader(""), &bytes.Buffer{}, &bytes.Buffer{})
}

// list and get never print a password, not even of a doc the consumers refuse for it (written
// here past the validation design doc, as a server that does not run it would take it).
func TestRulesListHidesPasswords(t *testing.T) {
	e := newEnv(t)
	design := e.storedRule(t, "_design/spiegel")
	require.NotNil(t, design)
	e.deleteDoc(t, e.cfg.DBName, "_design/spiegel", design["_rev"].(string))
	const secret = "s3cr3t-pw"
	e.putRule(t, "plain", map[string]any{"type": "replicator", "source": "http://bob:" + secret + "@a.example/db",
		"target": "https://bob:" + secret + "@b.example/db"})
	e.putRule(t, "slash", map[string]any{"type": "replicator", "source": "db", "target": "https://bob:" + secret + "/x@b.example/db"})
	e.putRule(t, "hook", map[string]any{"type": "on_change", "url": "https://bob:" + secret + "@api.example/h"})

	text := e.run(t, "rules", "list")
	asJSON := e.run(t, "rules", "list", "--json")
	got := e.run(t, "rules", "get", "plain") + e.run(t, "rules", "get", "--json", "slash")
	for _, out := range []string{text, asJSON, got} {
		assert.NotContains(t, out, secret)
		assert.Contains(t, out, "xxxxx")
	}
	assert.Contains(t, text, "password in URL")
	assert.Contains(t, asJSON, "https://bob:xxxxx@api.example/h")
}

// validate needs no configuration at all: not even SPIEGEL_COUCHDB_URL.
func TestRulesValidateOffline(t *testing.T) {
	for _, k := range []string{"SPIEGEL_COUCHDB_URL", "SPIEGEL_DB_NAME", "SPIEGEL_NATS_URL", "COUCHDB_URL"} {
		t.Setenv(k, "")
		require.NoError(t, os.Unsetenv(k))
	}
	dir := t.TempDir()
	good := writeFile(t, dir, "good.json", `[{"_id": "a", "type": "replicator", "source": "x", "target": "y"},
	  {"_id": "b", "type": "on_change", "subject": "orders.${db_name}", "retry": {"backoff": "linear"}}]`)
	bad := writeFile(t, dir, "bad.json", `[{"_id": "c", "type": "on_change", "url": "https://api.example/x", "retry": {"backoff": "random"}},
	  {"_id": "d", "type": "replicator", "source": "x"}, {"_id": "e", "type": "on_chnage"}]`)

	out, _, err := runRulesCmd(t, config.Producer{}, "validate", good)
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^OK\s+.*good.json: rule "a" \(replicator\)$`, out)
	assert.Regexp(t, `(?m)^OK\s+.*good.json: rule "b" \(on_change\)$`, out)

	out, _, err = runRulesCmd(t, config.Producer{}, "validate", good, bad)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "3 of 5 rule docs invalid")
	assert.Contains(t, out, bad+`: rule "c": field "retry.backoff": must be "linear" or "exponential"`)
	assert.Contains(t, out, bad+`: rule "d": field "target": required`)
	assert.Contains(t, out, bad+`: rule "e": field "type": must be "replicator" or "on_change"`)

	out, _, err = runRulesCmd(t, config.Producer{}, "validate", "--json", bad)
	require.Error(t, err)
	var results []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &results))
	require.Len(t, results, 3)
	assert.Equal(t, "retry.backoff", results[0]["field"])
	assert.Equal(t, false, results[0]["valid"])

	var stdout, stderr bytes.Buffer
	assert.Equal(t, 0, realMain(t.Context(), []string{"rules", "validate", good}, nil, &stdout, &stderr), stderr.String())
	assert.Equal(t, 1, realMain(t.Context(), []string{"rules", "validate", bad}, nil, &stdout, &stderr))
	assert.Contains(t, stderr.String(), "producer rules: 3 of 3 rule docs invalid")
}

// Bad command lines exit 2 naming what is wrong, with or without configuration; each
// subcommand's --help lists its own flags with their defaults.
func TestRulesCommandLine(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "")
	require.NoError(t, os.Unsetenv("SPIEGEL_COUCHDB_URL"))
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"rules"}, "want a subcommand"},
		{[]string{"rules", "--bogus"}, "unknown flag --bogus"},
		{[]string{"rules", "sync"}, `unknown command "sync"`},
		{[]string{"rules", "list", "--color"}, "unknown flag --color"},
		{[]string{"rules", "apply", "--force", "x.json"}, "unknown flag --force"},
		{[]string{"rules", "validate", "--dry-run", "x.json"}, "unknown flag --dry-run"},
		{[]string{"rules", "apply"}, "want one or more rule files"},
		{[]string{"rules", "get"}, "want one rule id"},
		{[]string{"rules", "list", "extra"}, `unexpected arguments ["extra"]`},
	} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, 2, realMain(t.Context(), tc.args, nil, &stdout, &stderr), tc.args)
		assert.Contains(t, stderr.String(), tc.want, tc.args)
		_, _, err := runRulesCmd(t, config.Producer{}, tc.args[1:]...)
		var uerr usageError
		assert.ErrorAs(t, err, &uerr, tc.args)
	}
	for sub, flags := range map[string][]string{
		"list":     {`--json\s+\(default false\)`, `--timeout\s+\(default 15s`},
		"get":      {`--json\s+\(default false\)`},
		"apply":    {`--dry-run\s+\(default false\)`, `--json\s+\(default false\)`, `--timeout`},
		"delete":   {`--json\s+\(default false\)`},
		"validate": {`--subject-prefix\s+\(default spiegel\)`, `--json\s+\(default false\)`},
	} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 0, realMain(t.Context(), []string{"rules", sub, "--help"}, nil, &stdout, &stderr), sub)
		assert.Contains(t, stdout.String(), "producer rules "+sub+" [flags]", sub)
		for _, f := range flags {
			assert.Regexp(t, f, stdout.String(), sub)
		}
		if sub != "apply" {
			assert.NotContains(t, stdout.String(), "--dry-run", sub)
		}
	}
}
