package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// fakeCouch answers / and the config and membership endpoints as a CouchDB 3 cluster does;
// config maps a node to its [global_changes] section; status, when set, is the answer to every
// config read.
func fakeCouch(t *testing.T, welcome string, nodes []string, config map[string]map[string]string, status int) *couch.Client {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.URL.Path == "/":
			_, _ = w.Write([]byte(welcome))
		case r.URL.Path == "/_membership" && nodes != nil:
			_ = json.NewEncoder(w).Encode(map[string][]string{"all_nodes": nodes, "cluster_nodes": nodes})
		case strings.HasPrefix(r.URL.Path, "/_node/") && strings.HasSuffix(r.URL.Path, "/_config/global_changes"):
			if status != 0 {
				w.WriteHeader(status)
				if status == http.StatusUnauthorized {
					_, _ = w.Write([]byte(`{"error":"unauthorized","reason":"You are not a server admin."}`))
				} else {
					_, _ = w.Write([]byte(`{"error":"not_found","reason":"no_db_file"}`))
				}
				return
			}
			node := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/_node/"), "/_config/global_changes")
			section, ok := config[node]
			if !ok {
				w.WriteHeader(http.StatusPreconditionFailed)
				_, _ = w.Write([]byte(`{"error":"nodedown","reason":"` + node + ` is down"}`))
				return
			}
			_ = json.NewEncoder(w).Encode(section)
		default:
			w.WriteHeader(http.StatusNotFound)
			_, _ = w.Write([]byte(`{"error":"not_found","reason":"missing"}`))
		}
	}))
	t.Cleanup(srv.Close)
	u := strings.Replace(srv.URL, "http://", "http://admin:S3CRETPW@", 1)
	c, err := couch.New(couch.Config{URL: u, RequestTimeout: 5 * time.Second}, logrus.NewEntry(discardLogger()))
	require.NoError(t, err)
	return c
}

const couchWelcome = `{"couchdb":"Welcome","version":"3.3.3","vendor":{"name":"The Apache Software Foundation"}}`

// status reads every node's [global_changes] delays, says which are CouchDB's defaults, and
// hints at lowering the default on the nodes that have it, with no credentials anywhere.
func TestGlobalChangesPerNode(t *testing.T) {
	nodes := []string{"couchdb@a", "couchdb@b"}
	c := fakeCouch(t, couchWelcome, nodes, map[string]map[string]string{
		"couchdb@a": {"max_write_delay": "50", "max_event_delay": "10"},
		"couchdb@b": {},
	}, 0)
	gc := readGlobalChanges(t.Context(), c)
	require.True(t, gc.Known, gc.Reason)
	assert.Equal(t, 500, gc.MaxWriteDelayMS, "a cluster's floor is its slowest node's")
	assert.Equal(t, 25, gc.MaxEventDelayMS)
	assert.True(t, gc.Default)
	assert.True(t, gc.EventDefault)
	require.Len(t, gc.Nodes, 2)
	assert.Equal(t, globalChangesNode{Node: "couchdb@a", MaxWriteDelayMS: 50, MaxEventDelayMS: 10,
		MaxWriteDelayConfigured: "50", MaxEventDelayConfigured: "10"}, gc.Nodes[0])
	assert.Contains(t, gc.Hint, `/_node/couchdb@b/_config/global_changes/max_write_delay -d '"50"'`)
	assert.Contains(t, gc.Hint, "max_event_delay = 10 in the [global_changes] section of the local.ini of couchdb@b and restart the node")
	assert.NotContains(t, gc.Hint, "couchdb@a", "the node already lowered needs nothing")

	var out strings.Builder
	printGlobalChanges(&out, gc)
	got := out.String()
	assert.Contains(t, got, "differs between nodes")
	assert.Contains(t, got, "couchdb@a\t[global_changes] max_write_delay 50 ms, max_event_delay 10 ms (in effect once the node has restarted since it was set)")
	assert.Contains(t, got, "couchdb@b\t[global_changes] max_write_delay 500 ms (default, unset), max_event_delay 25 ms (default, unset)")
	assert.Contains(t, got, "hint\tCouchDB announces writes on _db_updates up to about 525 ms late")
	assert.Contains(t, got, latencyDocs)
	js, err := json.Marshal(gc)
	require.NoError(t, err)
	for _, s := range []string{got, string(js)} {
		assert.NotContains(t, s, "S3CRETPW")
		assert.NotContains(t, s, "admin:")
	}
}

// max_write_delay lowered on every node, max_event_delay left: one line, and a hint about the
// latter only, which CouchDB reads when a node starts (no _config command for it).
func TestGlobalChangesWriteDelayLowered(t *testing.T) {
	c := fakeCouch(t, couchWelcome, []string{"couchdb@a", "couchdb@b"}, map[string]map[string]string{
		"couchdb@a": {"max_write_delay": "50"}, "couchdb@b": {"max_write_delay": "50"},
	}, 0)
	gc := readGlobalChanges(t.Context(), c)
	require.True(t, gc.Known, gc.Reason)
	assert.False(t, gc.Default)
	assert.True(t, gc.EventDefault)
	var out strings.Builder
	printGlobalChanges(&out, gc)
	assert.Equal(t, "couchdb _db_updates delay\t[global_changes] max_write_delay 50 ms, max_event_delay 25 ms (default, unset) (all 2 nodes)\n"+
		"  hint\tCouchDB announces writes on _db_updates up to about 75 ms late (max_write_delay 50 ms + max_event_delay 25 ms): "+
		"that is the floor of the latency of every job the feed starts. To lower it, put max_event_delay = 10 in the [global_changes] "+
		"section of the local.ini of couchdb@a, couchdb@b and restart the node (CouchDB reads it only when the node starts) (see "+latencyDocs+")\n",
		out.String())
	assert.NotContains(t, gc.Hint, "_config/global_changes/max_event_delay", "a live change of it is not applied: no command for it")
}

// Both lowered on every node: one line, no hint.
func TestGlobalChangesLowered(t *testing.T) {
	c := fakeCouch(t, couchWelcome, []string{"couchdb@a", "couchdb@b"}, map[string]map[string]string{
		"couchdb@a": {"max_write_delay": "50", "max_event_delay": "10"}, "couchdb@b": {"max_write_delay": "50", "max_event_delay": "10"},
	}, 0)
	gc := readGlobalChanges(t.Context(), c)
	require.True(t, gc.Known, gc.Reason)
	assert.False(t, gc.Default)
	assert.False(t, gc.EventDefault)
	assert.Empty(t, gc.Hint)
	var out strings.Builder
	printGlobalChanges(&out, gc)
	assert.Equal(t, "couchdb _db_updates delay\t[global_changes] max_write_delay 50 ms, max_event_delay 10 ms "+
		"(in effect once the node has restarted since it was set) (all 2 nodes)\n", out.String())
}

// A server whose members cannot be listed is read at /_node/_local: the hint names "the node".
func TestGlobalChangesLocalNode(t *testing.T) {
	c := fakeCouch(t, couchWelcome, nil, map[string]map[string]string{"_local": {"max_write_delay": "50"}}, 0)
	gc := readGlobalChanges(t.Context(), c)
	require.True(t, gc.Known, gc.Reason)
	assert.Contains(t, gc.Hint, "the local.ini of the node and restart")
}

// What cannot be read is unknown, with the reason; nothing fails.
func TestGlobalChangesUnknown(t *testing.T) {
	for name, tc := range map[string]struct {
		c    *couch.Client
		want string
	}{
		"no server admin": {fakeCouch(t, couchWelcome, []string{"couchdb@a"}, nil, http.StatusUnauthorized),
			"needs a server admin"},
		"no config endpoint": {fakeCouch(t, couchWelcome, nil, nil, http.StatusNotFound),
			"the server has no /_node/{node}/_config endpoint"},
		"a node down": {fakeCouch(t, couchWelcome, []string{"couchdb@a"}, map[string]map[string]string{}, 0),
			"couchdb@a is down"},
		"not a number": {fakeCouch(t, couchWelcome, []string{"couchdb@a"}, map[string]map[string]string{"couchdb@a": {"max_write_delay": "soon"}}, 0),
			`max_write_delay "soon" is not a number of milliseconds`},
		"PouchDB Server": {fakeCouch(t, `{"express-pouchdb":"Welcome!","version":"4.2.0","vendor":{"name":"PouchDB authors"}}`, nil, nil, 0),
			"PouchDB Server has no [global_changes] settings"},
	} {
		t.Run(name, func(t *testing.T) {
			gc := readGlobalChanges(t.Context(), tc.c)
			assert.False(t, gc.Known)
			assert.Contains(t, gc.Reason, tc.want)
			assert.NotContains(t, gc.Reason, "S3CRETPW")
			var out strings.Builder
			printGlobalChanges(&out, gc)
			assert.Contains(t, out.String(), "couchdb _db_updates delay\tunknown: ")
		})
	}
}

// Against the suite's server: on PouchDB Server the delays are unknown; on Apache CouchDB they
// are the values its configuration holds (read back here), in the text and in --json. status
// only reads them.
func TestStatusShowsGlobalChanges(t *testing.T) {
	e := newEnv(t)
	var root map[string]any
	require.NoError(t, e.direct.Do(t, "GET", "/", nil, &root))
	_, pouch := root["express-pouchdb"]

	text := e.run(t, "status")
	t.Logf("status:\n%s", text)
	var out struct {
		GC     *globalChanges `json:"couchdb_global_changes"`
		Groups map[string]any `json:"groups"`
	}
	require.NoError(t, json.Unmarshal([]byte(e.run(t, "status", "--json")), &out))
	require.NotNil(t, out.GC)
	assert.NotEmpty(t, out.Groups, "the report's own fields are still there")
	if pouch {
		assert.False(t, out.GC.Known)
		assert.Contains(t, out.GC.Reason, "PouchDB Server")
		assert.Contains(t, text, "couchdb _db_updates delay  unknown: PouchDB Server")
		return
	}
	var section map[string]string
	require.NoError(t, e.direct.Do(t, "GET", "/_node/_local/_config/global_changes", nil, &section))
	require.True(t, out.GC.Known, out.GC.Reason)
	want := 500
	if v, ok := section["max_write_delay"]; ok {
		var err error
		want, err = strconv.Atoi(v)
		require.NoError(t, err)
	}
	assert.Equal(t, want, out.GC.MaxWriteDelayMS)
	assert.Regexp(t, `couchdb _db_updates delay\s+\[global_changes\] max_write_delay `+strconv.Itoa(want)+` ms`, text)
	assert.Equal(t, want == 500, out.GC.Default)
	if want == 500 {
		assert.Contains(t, text, "/_config/global_changes/max_write_delay -d '\"50\"'")
	}
	if _, set := section["max_event_delay"]; !set {
		assert.Contains(t, text, "max_event_delay = 10 in the [global_changes] section")
	}
	if u, err := url.Parse(e.cfg.CouchDBURL); err == nil {
		if pw, ok := u.User.Password(); ok {
			assert.NotContains(t, text, pw)
		}
	}
	var after map[string]string
	require.NoError(t, e.direct.Do(t, "GET", "/_node/_local/_config/global_changes", nil, &after))
	assert.Equal(t, section, after, "status changes nothing")
}
