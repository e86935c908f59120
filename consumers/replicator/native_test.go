package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/replicate"
)

func TestNativeOptions(t *testing.T) {
	t.Parallel()
	body := func(extra string) map[string]any {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(`{"source":"http://h/a","target":"http://h/b"`+extra+`}`), &m))
		return m
	}
	opt, err := nativeOptions(body(`,"create_target":true,"selector":{"type":"post"},"worker_batch_size":50,
		"worker_processes":2,"checkpoint_interval":1500,"http_connections":4,"use_checkpoints":true`))
	require.NoError(t, err)
	assert.Equal(t, replicate.Options{Source: "http://h/a", Target: "http://h/b", CreateTarget: true,
		Selector: map[string]any{"type": "post"}, BatchSize: 50, Workers: 2, CheckpointInterval: 1500 * time.Millisecond}, opt)

	opt, err = nativeOptions(body(`,"filter":"app/f","query_params":{"k":"v"}`))
	require.NoError(t, err)
	assert.Equal(t, "app/f", opt.Filter)
	assert.Equal(t, map[string]any{"k": "v"}, opt.QueryParams)

	opt, err = nativeOptions(body(`,"doc_ids":["x","y"]`))
	require.NoError(t, err)
	assert.Equal(t, []string{"x", "y"}, opt.DocIDs)

	for extra, want := range map[string]string{
		`,"create_target":"yes"`:                          "rule field create_target: must be true or false",
		`,"doc_ids":["x",1]`:                              "rule field doc_ids: must be an array of strings",
		`,"doc_ids":["x"],"selector":{}`:                  "filter, doc_ids and selector exclude each other",
		`,"filter":"_selector"`:                           "filter _selector needs a selector",
		`,"worker_batch_size":0`:                          "rule field worker_batch_size: must be a positive integer",
		`,"worker_processes":1.5`:                         "rule field worker_processes: must be a positive integer",
		`,"checkpoint_interval":-1`:                       "rule field checkpoint_interval",
		`,"since_seq":"0"`:                                "rule field since_seq: not supported",
		`,"query_params":[1]`:                             "rule field query_params: must be an object",
		`,"selector":"x"`:                                 "rule field selector: must be an object",
		`,"filter":1`:                                     "rule field filter: must be a string",
		`,"doc_ids":"x"`:                                  "rule field doc_ids: must be an array of strings",
		`,"filter":"_doc_ids"`:                            "filter _doc_ids needs doc_ids",
		`,"filter":"app/f","selector":{"a":1}`:            "exclude each other",
		`,"filter":"app/f","doc_ids":["a"]`:               "exclude each other",
		`,"selector":{"a":1},"filter":"_doc_ids"`:         "filter _doc_ids needs doc_ids",
		`,"doc_ids":["a"],"filter":"_doc_ids"`:            "",
		`,"selector":{"a":1},"filter":"_selector"`:        "",
		`,"worker_batch_size":10,"checkpoint_interval":1`: "",
	} {
		_, err := nativeOptions(body(extra))
		if want == "" {
			assert.NoError(t, err, extra)
			continue
		}
		require.Error(t, err, extra)
		assert.Contains(t, err.Error(), want, extra)
		assert.Equal(t, permanent, classify(err), "a bad rule field cannot succeed by retrying: %s", extra)
	}
	_, err = nativeOptions(map[string]any{"source": map[string]any{"url": "http://h/a"}, "target": "http://h/b"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "rule field source: must be a URL string")
}

// The native engine's failures map onto the consumer's retry classes, and never show a password.
func TestNativeEngineErrors(t *testing.T) {
	t.Parallel()
	cs := newEnv(t, 10*time.Second).Couch
	eng := nativeEngine{hc: &http.Client{}}
	withAuth := func(db string) string { return strings.TrimRight(cs.URL, "/") + "/" + escapeDBName(db) }
	src := cs.NewDB(t, "nsrc")
	cs.Put(t, src, "a", map[string]any{"v": 1})

	// A missing target without create_target: db_not_found, retried for a while, then given up.
	_, err := eng.Replicate(t.Context(), map[string]any{"source": withAuth(src), "target": withAuth(src + "_missing")}, nil)
	require.Error(t, err)
	assert.Equal(t, dbNotFound, classify(err), "%v", err)
	assert.Contains(t, err.Error(), "native replication: 404 db_not_found")

	// A missing source: not a failure to retry (the handler acks the job with a warning).
	_, err = eng.Replicate(t.Context(), map[string]any{"source": withAuth(src + "_gone"), "target": withAuth(src)}, nil)
	require.ErrorIs(t, err, errSourceMissing)

	// create_target creates it.
	res, err := eng.Replicate(t.Context(), map[string]any{"source": withAuth(src), "target": withAuth(src + "_made"), "create_target": true}, nil)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.DocsWritten)
	t.Cleanup(func() { _ = cs.Do(t, http.MethodDelete, "/"+escapeDBName(src+"_made"), nil, nil) })

	// Credentials refused (a server a real CouchDB cannot be made into on demand: every
	// request answers 401): permanent, and the password appears nowhere.
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = w.Write([]byte(`{"error":"unauthorized","reason":"Name or password is incorrect."}`))
	}))
	defer refusing.Close()
	secret := "s3cret-pass-word"
	u := "http://admin:" + secret + "@" + refusing.Listener.Addr().String() + "/db"
	_, err = eng.Replicate(t.Context(), map[string]any{"source": u, "target": withAuth(src)}, []string{secret})
	require.Error(t, err)
	assert.Equal(t, permanent, classify(err), "%v", err)
	assert.NotContains(t, err.Error(), secret)
	assert.Contains(t, err.Error(), "401")

	// Nobody listening: transient.
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := "http://admin:" + secret + "@" + dead.Listener.Addr().String() + "/db"
	dead.Close()
	_, err = eng.Replicate(t.Context(), map[string]any{"source": deadURL, "target": withAuth(src)}, []string{secret})
	require.Error(t, err)
	assert.Equal(t, transient, classify(err), "%v", err)
	assert.NotContains(t, err.Error(), secret)
}

// A rule with "engine": "native" works through the consumer end to end: existing docs, later
// writes and deletions replicate; a job with nothing new writes nothing.
func TestNativeEngineRule(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	db1, db2 := e.Prefix+"n1", e.Prefix+"n2"
	e.Couch.CreateDB(t, db1)
	e.Couch.CreateDB(t, db2)
	for i := range 5 {
		e.Couch.Put(t, db1, fmt.Sprintf("old%d", i), map[string]any{"i": i})
	}
	p := e.startReplicator(t, nil)
	e.Couch.Put(t, e.cfg.DBName, "native", map[string]any{"type": "replicator", "source": db1, "target": db2, "engine": "native"})
	p.waitRule(t, db1)
	e.publish(t, db1)
	waitConverged(t, e.Couch, db1, db2, 20*time.Second)

	e.Couch.Put(t, db1, "new", map[string]any{"fresh": true})
	var doc struct {
		Rev string `json:"_rev"`
	}
	require.NoError(t, e.Couch.Do(t, http.MethodGet, "/"+escapeDBName(db1)+"/old0", nil, &doc))
	require.NoError(t, e.Couch.Do(t, http.MethodDelete, "/"+escapeDBName(db1)+"/old0?rev="+doc.Rev, nil, nil))
	e.publish(t, db1)
	waitConverged(t, e.Couch, db1, db2, 20*time.Second)
	assert.Len(t, revs(t, e.Couch, db2), 5, "old0 deleted on the target too")

	e.publish(t, db1)
	require.Eventually(t, func() bool { return len(p.replications(db1)) >= 3 }, 20*time.Second, 20*time.Millisecond)
	e.waitQuiet(t, p, 20*time.Second)
	logs := e.Logs.String()
	assert.Contains(t, logs, `"engine":"native"`)
	assert.Contains(t, logs, `"docs_written":5`)
	assert.Contains(t, logs, `"docs_written":0`, "the third run found nothing new to write")
	assert.Empty(t, e.deadLetters(t))

	kv, err := natsjs.OnChangeBucket(t.Context(), e.JS, natsjs.DefaultTopology(e.cfg.SubjectPrefix))
	require.NoError(t, err)
	keys, err := kv.ListKeys(t.Context())
	require.NoError(t, err)
	var fences []string
	for k := range keys.Keys() {
		if strings.HasPrefix(k, "replication.") {
			fences = append(fences, k)
		}
	}
	assert.Len(t, fences, 1, "the runs of the replication are fenced by one token")
}

// SPIEGEL_REPLICATION_ENGINE=native makes native the engine of rules that name none: a pattern
// rule with URLs and passwords from the passwords file, creating its targets.
func TestNativeEngineByDefault(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	cfg := e.cfg
	cfg.Engine = "native"
	base, pwFile := e.ruleURL(t, "")
	cfg.PasswordsFile = writePasswords(t, pwFile)
	users := []string{e.Prefix + "u_1", e.Prefix + "u_2"}
	for _, u := range users {
		e.Couch.CreateDB(t, u)
		e.Couch.Put(t, u, "doc", map[string]any{"owner": u})
	}
	p := e.startReplicator(t, &cfg)
	e.Couch.Put(t, e.cfg.DBName, "pattern", map[string]any{
		"type": "replicator", "db_name": "^" + e.Prefix + "u_", "source": base + "$db_name",
		"target": base + "${db_name}_copy", "create_target": true,
	})
	p.waitRule(t, users[0])
	for _, u := range users {
		e.publish(t, u)
	}
	for _, u := range users {
		waitConverged(t, e.Couch, u, u+"_copy", 20*time.Second)
		t.Cleanup(func() { _ = e.Couch.Do(t, http.MethodDelete, "/"+escapeDBName(u+"_copy"), nil, nil) })
	}
	assert.Contains(t, e.Logs.String(), `"engine":"native"`)
}
