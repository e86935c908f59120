package couchtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// send sends method path with body (JSON text, "" for none) through the proxy and returns the
// status and the answer.
func send(t *testing.T, p *couchtest.UpdatesProxy, method, path, body string) (int, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitLimit)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, p.URL()+path, rd)
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.Server().HTTP.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, data
}

// couchError decodes CouchDB's {"error","reason"} answer.
func couchError(t *testing.T, body []byte) (string, string) {
	t.Helper()
	var e struct{ Error, Reason string }
	require.NoError(t, json.Unmarshal(body, &e), "decode %s", body)
	return e.Error, e.Reason
}

func TestUpdatesProxyRejectsBadFeedRequestsAsCouchDBDoes(t *testing.T) {
	t.Parallel()
	other := couchtest.Get(t).NewUpdatesProxy(t, couchtest.AlwaysSynthesize(), couchtest.CoalesceWindow(0))
	other.Server().NewDB(t, "other")
	foreign := readUpdates(t, other, "feed=normal").LastSeq
	const malformed = "Malformed sequence supplied in 'since' parameter."
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		cases := []struct {
			name, query, reason string
		}{
			{"garbage since", "since=garbage", malformed},
			{"integer since", "since=12", malformed},
			{"unknown feed", "feed=sideways", "Supported `feed` types: normal, continuous, longpoll, eventsource"},
			{"bad limit", "limit=ten", "invalid_integer"},
			{"negative timeout", "feed=longpoll&timeout=-1", "invalid_integer"},
		}
		if p.Synthetic() {
			cases = append(cases, struct{ name, query, reason string }{
				"another proxy's seq", "since=" + foreign, malformed,
			})
		}
		for _, tc := range cases {
			status, body := get(t, p, "/_db_updates?"+tc.query)
			assert.Equal(t, http.StatusBadRequest, status, "%s: %s", tc.name, body)
			name, reason := couchError(t, body)
			assert.Equal(t, "bad_request", name, tc.name)
			assert.Equal(t, tc.reason, reason, tc.name)
		}
		status, body := send(t, p, http.MethodPost, "/_db_updates", "{}")
		assert.Equal(t, http.StatusMethodNotAllowed, status, "POST /_db_updates: %s", body)
	})
}

func TestUpdatesProxyAnswersDBsInfo(t *testing.T) {
	t.Parallel()
	eachMode(t, nil, func(t *testing.T, p *couchtest.UpdatesProxy) {
		ps := p.Server()
		db := couchtest.UniqueName(t, "i") + "/x" // escaped as %2F on the way to the server
		ps.CreateDB(t, db)
		ps.Put(t, db, "doc", map[string]int{"a": 1})
		missing := db + "_missing"

		keys, _ := json.Marshal(map[string][]string{"keys": {db, missing}})
		status, body := send(t, p, http.MethodPost, "/_dbs_info", string(keys))
		require.Equal(t, http.StatusOK, status, "%s", body)
		var rows []struct {
			Key  string `json:"key"`
			Info *struct {
				DBName   string `json:"db_name"`
				DocCount int    `json:"doc_count"`
			} `json:"info"`
			Error string `json:"error"`
		}
		require.NoError(t, json.Unmarshal(body, &rows), "%s", body)
		require.Len(t, rows, 2, "%s", body)
		assert.Equal(t, db, rows[0].Key)
		var direct struct {
			DBName string `json:"db_name"`
		}
		require.NoError(t, ps.Do(t, http.MethodGet, "/"+couchtest.PathDB(db), nil, &direct))
		if assert.NotNil(t, rows[0].Info, "%s", body) {
			// PouchDB Server names "a/x" "ax" in its info: the proxy passes the server's info.
			assert.Equal(t, direct.DBName, rows[0].Info.DBName)
			assert.Equal(t, 1, rows[0].Info.DocCount)
		}
		assert.Empty(t, rows[0].Error)
		assert.Equal(t, missing, rows[1].Key)
		assert.Equal(t, "not_found", rows[1].Error)
		assert.Nil(t, rows[1].Info)

		many := make([]string, 101)
		for i := range many {
			many[i] = fmt.Sprintf("db%d", i)
		}
		keys, _ = json.Marshal(map[string][]string{"keys": many})
		for _, tc := range []struct{ body, reason string }{
			{string(keys), "too_many_keys"},
			{"{}", "`keys` member must exist."},
		} {
			status, body := send(t, p, http.MethodPost, "/_dbs_info", tc.body)
			assert.Equal(t, http.StatusBadRequest, status, "%s", body)
			_, reason := couchError(t, body)
			assert.Equal(t, tc.reason, reason)
		}
	})
}

func TestUpdatesProxyCountsWritesButNotReadsOrLocalDocs(t *testing.T) {
	t.Parallel()
	eachMode(t, []couchtest.UpdatesProxyOption{couchtest.CoalesceWindow(0)}, func(t *testing.T, p *couchtest.UpdatesProxy) {
		ps := p.Server()
		db := couchtest.UniqueName(t, "w")
		path := "/" + couchtest.PathDB(db)
		changed := func(writes, events int, what string) {
			t.Helper()
			assert.Equal(t, writes, p.Writes(), "writes after %s", what)
			if p.Synthetic() {
				assert.Equal(t, events, p.Events(), "events after %s", what)
			} else {
				assert.Zero(t, p.Events(), "a pass-through proxy has no events of its own")
			}
		}
		changed(0, 0, "nothing")
		ps.CreateDB(t, db)
		changed(1, 1, "PUT "+path)

		reads := []struct{ method, path, body string }{
			{http.MethodGet, path, ""},
			{http.MethodPut, path + "/_local/x", `{"a":1}`},
			{http.MethodPost, path + "/_all_docs", `{"keys":["x"]}`},
			{http.MethodPost, path + "/_find", `{"selector":{}}`},
			{http.MethodGet, path + "/_changes", ""},
		}
		for _, r := range reads {
			status, body := send(t, p, r.method, r.path, r.body)
			require.Less(t, status, 300, "%s %s: %s", r.method, r.path, body)
			changed(1, 1, r.method+" "+r.path)
		}
		status, _ := send(t, p, http.MethodPut, path, "")
		require.Equal(t, http.StatusPreconditionFailed, status, "the db exists")
		changed(1, 1, "a failed PUT "+path)

		ps.Put(t, db, "doc", map[string]int{"a": 1})
		changed(2, 2, "PUT "+path+"/doc")

		assert.Equal(t, 4, p.Requests(http.MethodPut, path), "PUT db, _local, db again, doc")
		assert.Equal(t, 0, p.Requests("", "/_db_updates"))
		readUpdates(t, p, "feed=normal&since=now")
		assert.Equal(t, 1, p.Requests(http.MethodGet, "/_db_updates"))
	})
}

func TestUpdatesProxyCoalescesWritesUntilTheWindowEnds(t *testing.T) {
	t.Parallel()
	p := couchtest.Get(t).NewUpdatesProxy(t, couchtest.AlwaysSynthesize(), couchtest.CoalesceWindow(time.Hour))
	start := readUpdates(t, p, "feed=normal&since=now").LastSeq
	ps := p.Server()
	db := couchtest.UniqueName(t, "co")
	ps.CreateDB(t, db)
	for i := range 3 {
		ps.Put(t, db, fmt.Sprintf("doc%d", i), map[string]int{"i": i})
	}
	assert.Equal(t, 4, p.Writes())
	assert.Zero(t, p.Events(), "no row before the window ends")
	assert.Empty(t, readUpdates(t, p, "feed=normal&since="+start).Results)

	p.Flush()
	assert.Equal(t, 2, p.Events(), "one row per type and db")
	rows := readUpdates(t, p, "feed=normal&since="+start).Results
	assert.Equal(t, []string{"created", "updated"}, typesOf(rows, db))
	assert.Len(t, rows, 2, "%+v", rows)
}
