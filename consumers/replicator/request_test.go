package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/passwords"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// compile parses one rule doc into a *rules.Replicator.
func compile(t *testing.T, id string, doc map[string]any) *rules.Replicator {
	t.Helper()
	raw, err := json.Marshal(doc)
	require.NoError(t, err)
	r, err := rules.Parse(id, raw)
	require.NoError(t, err)
	rep, ok := r.(*rules.Replicator)
	require.True(t, ok)
	return rep
}

func passwordsFile(t *testing.T, content string) *passwords.File {
	t.Helper()
	path := filepath.Join(t.TempDir(), "passwords.json")
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	pw, err := passwords.Load(path)
	require.NoError(t, err)
	return pw
}

func TestBuildRequest(t *testing.T) {
	t.Parallel()
	base, _ := url.Parse("http://admin:adminPW1@couch.local:5984")
	pw := passwordsFile(t, `{"src.example": {"alice": "alicePW99"}, "dst.example:6984": {"bob": "b/o@b PW"}}`)
	cases := []struct {
		name      string
		doc       map[string]any
		db        string
		source    string
		target    string
		secrets   []string
		extra     map[string]any
		shownSrc  string
		notInBody []string
	}{
		{
			name: "bare names become URLs on the watched server with its credentials",
			doc:  map[string]any{"type": "replicator", "source": "db1", "target": "db2"},
			db:   "db1", source: "http://admin:adminPW1@couch.local:5984/db1", target: "http://admin:adminPW1@couch.local:5984/db2",
			secrets: []string{"adminPW1", "adminPW1"}, shownSrc: "http://admin:xxxxx@couch.local:5984/db1",
		},
		{
			name: "URLs get their passwords from the file; pass-through fields, never continuous or cancel",
			doc: map[string]any{"type": "replicator", "source": "https://alice@src.example/db1", "target": "https://bob@dst.example:6984/copy",
				"filter": "app/f", "query_params": map[string]any{"a": "b"}, "create_target": true, "continuous": true, "cancel": true,
				"dirty_after_milliseconds": 10, "disabled": false, "dirty": true, "locked_at": "x"},
			db: "db1", source: "https://alice:alicePW99@src.example/db1", target: "https://bob:b%2Fo%40b%20PW@dst.example:6984/copy",
			secrets: []string{"alicePW99", "b/o@b PW"}, shownSrc: "https://alice:xxxxx@src.example/db1",
			extra:     map[string]any{"filter": "app/f", "query_params": map[string]any{"a": "b"}, "create_target": true},
			notInBody: []string{"continuous", "cancel", "type", "dirty_after_milliseconds", "disabled", "dirty", "locked_at", "_id"},
		},
		{
			name: "pattern rule: special names escaped in URLs and bare names",
			doc:  map[string]any{"type": "replicator", "db_name": "^u", "source": "$db_name", "target": "https://alice@src.example/all_${db_name}"},
			db:   "u/a+b$c(d)", source: "http://admin:adminPW1@couch.local:5984/u%2Fa%2Bb%24c%28d%29",
			target: "https://alice:alicePW99@src.example/all_u%2Fa%2Bb%24c%28d%29", secrets: []string{"adminPW1", "alicePW99"},
			shownSrc: "http://admin:xxxxx@couch.local:5984/u%2Fa%2Bb%24c%28d%29",
		},
		{
			name: "a user with no password in the file stays without one",
			doc:  map[string]any{"type": "replicator", "source": "https://carol@src.example/db1", "target": "db2"},
			db:   "db1", source: "https://carol@src.example/db1", target: "http://admin:adminPW1@couch.local:5984/db2",
			secrets: []string{"adminPW1"}, shownSrc: "https://carol@src.example/db1",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := compile(t, "r1", c.doc)
			req, err := buildRequest(r, c.db, base, pw)
			require.NoError(t, err)
			assert.Equal(t, c.source, req.Body["source"])
			assert.Equal(t, c.target, req.Body["target"])
			assert.ElementsMatch(t, c.secrets, req.Secrets)
			assert.Equal(t, c.shownSrc, req.Source)
			for k, v := range c.extra {
				assert.Equal(t, v, req.Body[k], k)
			}
			for _, k := range c.notInBody {
				assert.NotContains(t, req.Body, k)
			}
			assert.NotContains(t, req.Source+req.Target, "PW", "shown endpoints must be redacted")
			_, err = json.Marshal(req.Body)
			assert.NoError(t, err)
		})
	}
}

func TestBuildRequestDoesNotModifyRuleParams(t *testing.T) {
	t.Parallel()
	base, _ := url.Parse("http://couch.local:5984")
	r := compile(t, "r1", map[string]any{"type": "replicator", "source": "a", "target": "b", "filter": "x/y"})
	_, err := buildRequest(r, "a", base, passwordsFile(t, `{}`))
	require.NoError(t, err)
	assert.NotContains(t, r.Params, "source")
	assert.NotContains(t, r.Params, "target")
}

func TestClassify(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		err  error
		want failureKind
	}{
		{"connection refused", &scrubbedError{msg: "dial", err: errors.New("connection refused")}, transient},
		{"timeout", context.DeadlineExceeded, transient},
		{"401", &replicateError{Status: 401, ErrorName: "unauthorized"}, permanent},
		{"403", &replicateError{Status: 403}, permanent},
		{"couchdb auth 500", &replicateError{Status: 500, ErrorName: "replication_auth_error",
			Reason: `{session_request_unauthorized,"http://127.0.0.1:5984/_session","admin"}`}, permanent},
		{"couchdb session request cut", &replicateError{Status: 500, ErrorName: "replication_auth_error",
			Reason: `{session_request_failed,"http://127.0.0.1:37783/_session","admin",sel_conn_closed}`}, transient},
		{"couchdb db_not_found", &replicateError{Status: 500, ErrorName: "db_not_found"}, dbNotFound},
		{"pouchdb unreachable target", &replicateError{Status: 400, ErrorName: "bad_request",
			Reason: "request to http://127.0.0.1:1/tgt2/ failed, reason: connect ECONNREFUSED 127.0.0.1:1"}, transient},
		{"bad parameter", &replicateError{Status: 400, ErrorName: "bad_request", Reason: "invalid filter"}, permanent},
		{"missing filter", &replicateError{Status: 404, ErrorName: "not_found", Reason: "missing"}, permanent},
		{"503", &replicateError{Status: 503}, transient},
		{"500 crash page", &replicateError{Status: 500, Reason: "<html>TypeError"}, transient},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			assert.Equal(t, c.want, classify(c.err))
		})
	}
}

func TestScrubRemovesSecrets(t *testing.T) {
	t.Parallel()
	s := scrub(`request to http://bob:b%2Fo%40b%20PW@h/db failed; pw=b/o@b PW; http://u:plainPW@x/`, []string{"b/o@b PW", "plainPW"})
	assert.NotContains(t, s, "PW")
	err := replicateAnswer(t, 400, []byte(`{"error":"bad_request","reason":"request to http://a:s3cretXY@h/db failed: s3cretXY"}`), []string{"s3cretXY"})
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "s3cretXY")
}
