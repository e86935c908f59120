package main

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// install runs twice and concurrently without error and leaves one complete installation.
func TestInstallIdempotentAndConcurrent(t *testing.T) {
	e := newEnv(t) // installs once
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var out bytes.Buffer
			cfg := e.cfg
			errs[i] = runInstall(context.Background(), &cfg, discardLogger(), cmdIO{stdout: &out, stderr: &out})
		}()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	var ddoc map[string]any
	require.NoError(t, e.Couch.Do(t, "GET", "/"+e.cfg.DBName+"/_design/spiegel", nil, &ddoc))
	assert.Contains(t, ddoc["validate_doc_update"], "password in URL")
	var sec map[string]any
	require.NoError(t, e.Couch.Do(t, "GET", "/"+e.cfg.DBName+"/_security", nil, &sec))
	assert.Contains(t, sec, "members")
	for _, s := range []string{"SPIEGEL_WORK", "SPIEGEL_DEADLETTER", "SPIEGEL_CHANGES"} {
		_, err := e.JS.Stream(t.Context(), s)
		assert.NoError(t, err, s)
	}
}

// The validate_doc_update rejects invalid rule docs at write time, naming field and reason.
func TestValidateDocUpdateRejectsInvalidRules(t *testing.T) {
	e := newEnv(t)
	bad := []struct {
		doc  map[string]any
		want string
	}{
		{map[string]any{"type": "replicator", "source": "http://u:pw@h/db", "target": "x"}, "password in URL"},
		{map[string]any{"type": "replicator", "target": "x"}, "source"},
		{map[string]any{"type": "on_change", "url": "http://h/", "method": "FETCH"}, "method"},
		{map[string]any{"type": "on_change"}, "exactly one of url, subject and mirror"},
		{map[string]any{"type": "on_change", "url": "http://h/", "mirror": "docs"}, "exactly one of url, subject and mirror"},
		{map[string]any{"type": "on_change", "mirror": "a.b"}, "bucket name"},
		{map[string]any{"type": "on_change", "url": "http://h/", "db_name": "("}, "db_name"},
		{map[string]any{"type": "on_change", "url": "http://h/", "follow_redirects": "yes"}, "follow_redirects"},
	}
	for i, c := range bad {
		err := e.Couch.Do(t, "PUT", "/"+e.cfg.DBName+"/bad"+string(rune('a'+i)), c.doc, nil)
		require.Error(t, err, "%v", c.doc)
		assert.Contains(t, err.Error(), c.want)
	}
	e.putRule(t, "good", map[string]any{"type": "on_change", "url": "http://h/", "if": map[string]any{"x": nil}})
	e.putRule(t, "mirror", map[string]any{"type": "on_change", "mirror": "docs"})
}

// uninstall asks first; without a "yes" nothing is deleted.
func TestUninstallAsksFirst(t *testing.T) {
	e := newEnv(t)
	var out, errOut bytes.Buffer
	cfg := e.cfg
	err := runUninstall(t.Context(), &cfg, discardLogger(), cmdIO{stdin: strings.NewReader("no\n"), stdout: &out, stderr: &errOut})
	require.Error(t, err)
	assert.Contains(t, errOut.String(), "Type \"yes\"")
	_, err = e.JS.Stream(t.Context(), "SPIEGEL_WORK")
	require.NoError(t, err, "stream deleted without confirmation")

	err = runUninstall(t.Context(), &cfg, discardLogger(), cmdIO{args: []string{"--yes"}, stdin: strings.NewReader(""), stdout: &out, stderr: &errOut})
	require.NoError(t, err)
	assert.Contains(t, out.String(), "db identities (_local/spiegel_db in the watched dbs): kept")
	_, err = e.JS.Stream(t.Context(), "SPIEGEL_WORK")
	assert.Error(t, err)
	assert.Error(t, e.Couch.Do(t, "GET", "/"+e.cfg.DBName, nil, nil), "spiegel db still there")
}

// resync enqueues every matched db; status reports rules (with rejections, without secrets),
// pending jobs and the position.
func TestResyncAndStatus(t *testing.T) {
	e := newEnv(t)
	for _, n := range []string{"r1", "r2", "r3", "x1"} {
		e.Couch.CreateDB(t, e.Prefix+n)
	}
	e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + "r", "source": "$db_name", "target": e.Prefix + "all"})
	// An invalid rule, written straight past the validation (as on a server without JavaScript):
	// it must be reported, not loaded, and its URL's password must not leak.
	require.NoError(t, e.Couch.Do(t, "DELETE", "/"+e.cfg.DBName+"/_design/spiegel?rev="+ddocRev(t, e), nil, nil))
	e.putRule(t, "leaky", map[string]any{"type": "on_change", "url": "http://u:SECRETPW@hook.example/"})

	out := e.run(t, "resync", "--db", "r[12]$")
	assert.Contains(t, out, "enqueued 2 jobs")
	p := e.Pending(t)
	assert.Equal(t, uint64(1), p[work(events.GroupReplicate, e.Prefix+"r1")])
	assert.Equal(t, uint64(1), p[work(events.GroupReplicate, e.Prefix+"r2")])
	assert.Zero(t, p[work(events.GroupReplicate, e.Prefix+"r3")])

	out = e.run(t, "resync")
	assert.Contains(t, out, "enqueued 1 jobs (2 were already pending)")

	status := e.run(t, "status")
	assert.Contains(t, status, "replicator 1")
	assert.Contains(t, status, "rejected 1")
	assert.Contains(t, status, "leaky")
	assert.Regexp(t, `jobs replicate\s+pending 3,`, status)
	assert.NotContains(t, status, "SECRETPW")
	js := e.run(t, "status", "--json")
	assert.Contains(t, js, `"pending": 3`)
	assert.NotContains(t, js, "SECRETPW")
	// A rejected rule has no per-rule status; the summary names it.
	js = e.run(t, "status", "--json", "--rule", "leaky")
	assert.Contains(t, js, `"per_rule": []`)
	assert.Contains(t, js, `"leaky"`)
	assert.NotContains(t, js, "SECRETPW")
}

func ddocRev(t *testing.T, e *env) string {
	var d struct {
		Rev string `json:"_rev"`
	}
	require.NoError(t, e.Couch.Do(t, "GET", "/"+e.cfg.DBName+"/_design/spiegel", nil, &d))
	return d.Rev
}

// --help and --version work for every command without configuration.
func TestHelpAndVersion(t *testing.T) {
	for _, cmd := range []string{"", "install", "uninstall", "resync", "replay", "status"} {
		var out bytes.Buffer
		args := []string{"--help"}
		if cmd != "" {
			args = append([]string{cmd}, args...)
		}
		require.Equal(t, 0, realMain(context.Background(), args, strings.NewReader(""), &out, &out), cmd)
		assert.Contains(t, out.String(), "SPIEGEL_COUCHDB_URL", cmd)
	}
	var out bytes.Buffer
	require.Equal(t, 0, realMain(context.Background(), []string{"--version"}, nil, &out, &out))
	assert.Contains(t, out.String(), "producer ")
	out.Reset()
	assert.Equal(t, 2, realMain(context.Background(), []string{"frobnicate"}, nil, &out, &out))
	assert.Contains(t, out.String(), "unknown command")
}

// Bad configuration stops the producer at start with the variable's name.
func TestBadConfigNamesVariable(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:1")
	t.Setenv("SPIEGEL_POLL_INTERVAL", "often")
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	assert.Equal(t, 2, realMain(ctx, nil, strings.NewReader(""), &out, &out))
	assert.Contains(t, out.String(), "SPIEGEL_POLL_INTERVAL")
}
