package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// gate is a proxy to the CouchDB under test that refuses every request (401, as a server with
// a changed password does) while closed.
type gate struct {
	*httptest.Server
	closed atomic.Bool
}

func newGate(t testing.TB, couchURL string) *gate {
	t.Helper()
	u, err := url.Parse(couchURL)
	require.NoError(t, err)
	g := &gate{}
	rp := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: u.Scheme, Host: u.Host})
	direct := rp.Director
	rp.Director = func(r *http.Request) {
		direct(r)
		if u.User != nil {
			pw, _ := u.User.Password()
			r.SetBasicAuth(u.User.Username(), pw)
		}
	}
	g.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.closed.Load() {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = io.WriteString(w, `{"error":"unauthorized","reason":"Name or password is incorrect."}`)
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(g.Close)
	return g
}

// failingSink is a webhook that answers 500 while failing, 200 otherwise, and records the doc
// ids it answered 200 for.
type failingSink struct {
	*httptest.Server
	failing atomic.Bool
	mu      sync.Mutex
	ok      map[string]int
}

func newFailingSink(t testing.TB) *failingSink {
	s := &failingSink{ok: map[string]int{}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.failing.Load() {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		s.mu.Lock()
		s.ok[r.URL.Query().Get("id")]++
		s.mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *failingSink) delivered(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ok[id]
}

// dlRecord is what `producer deadletters list --json` prints for a record.
type dlRecord struct {
	ID    uint64 `json:"id"`
	Group string `json:"group"`
	DB    string `json:"db"`
	Rule  string `json:"rule"`
	Seq   string `json:"seq"`
	Since string `json:"since"`
	DocID string `json:"doc_id"`
	Error string `json:"error"`
}

// TestDeadLettersListRetryPurge: dead letters made by a failing webhook and by a replication
// target that refuses the credentials are listed with their filters; after the causes are
// fixed, `deadletters retry` re-drives them — the webhook receives the changes, the target
// converges — and deletes them; `purge` deletes the rest. Bad input and an unconfirmed retry
// change nothing, and no output shows a password.
func TestDeadLettersListRetryPurge(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole pipeline")
	}
	root := repoRoot(t, "producer", "replicator", "onchange")
	bin := func(name string) string { return filepath.Join(root, "bin", name) }
	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	sink := newFailingSink(t)
	sink.failing.Store(true)
	target := newGate(t, cs.URL)
	target.closed.Store(true)

	spiegelDB := couchtest.UniqueName(t, "e2e_dl_spiegel_")
	src := couchtest.UniqueName(t, "e2e_dl_src_")
	tgt := src + "_copy"
	cs.Cleanup(t, spiegelDB) // made by `producer install`
	cs.Cleanup(t, src)
	cs.Cleanup(t, tgt)
	env := baseEnv(
		"SPIEGEL_COUCHDB_URL="+cs.URL, "SPIEGEL_DB_NAME="+spiegelDB, "SPIEGEL_NATS_URL="+ns.URL(),
		"SPIEGEL_SUBJECT_PREFIX=e2edl", "SPIEGEL_POLL_INTERVAL=200ms", "SPIEGEL_RETRY_INITIAL=200ms",
		"SPIEGEL_RETRY_MAX=1s", "SPIEGEL_LOG_LEVEL=debug",
	)
	with := func(extra ...string) []string { return append(slices.Clone(env), extra...) }
	var outs []string
	admin := func(wantCode int, stdin string, args ...string) string {
		t.Helper()
		stdout, stderr, code := runCmdIO(t, bin("producer"), env, stdin, args...)
		out := stdout + stderr
		outs = append(outs, out)
		require.Equal(t, wantCode, code, "producer %s:\n%s", strings.Join(args, " "), out)
		return out
	}
	list := func(args ...string) []dlRecord {
		t.Helper()
		out, stderr, code := runCmdIO(t, bin("producer"), env, "", append([]string{"deadletters", "list", "--json"}, args...)...)
		outs = append(outs, out, stderr)
		require.Equal(t, 0, code, stderr)
		var recs []dlRecord
		require.NoError(t, json.Unmarshal([]byte(out), &recs), out)
		return recs
	}

	admin(0, "", "install")
	cs.Put(t, spiegelDB, "hook", map[string]any{"type": "on_change", "db_name": "^" + src + "$", "method": "GET",
		"url": sink.URL + "/hook", "params": map[string]any{"id": "$change.id"},
		"retry": map[string]any{"backoff": "linear", "delay_ms": 50, "limit": 1}})
	cs.Put(t, spiegelDB, "copy", map[string]any{"type": "replicator", "db_name": "^" + src + "$", "source": "$db_name",
		"target": target.URL + "/" + url.PathEscape(tgt), "create_target": true})

	addrs := []string{freeAddr(t), freeAddr(t), freeAddr(t)}
	procs := []*proc{
		startProc(t, "producer", bin("producer"), addrs[0], with("SPIEGEL_HTTP_ADDR="+addrs[0])),
		startProc(t, "replicator", bin("replicator"), addrs[1], with("SPIEGEL_HTTP_ADDR="+addrs[1])),
		startProc(t, "onchange", bin("onchange"), addrs[2], with("SPIEGEL_HTTP_ADDR="+addrs[2])),
	}
	for _, p := range procs {
		waitFor(t, 30*time.Second, p.name+" ready", procs, func() bool { code, _ := p.get("/readyz"); return code == http.StatusOK })
	}
	cs.CreateDB(t, src)
	docs := []string{"d1", "d2", "d3"}
	for _, id := range docs {
		cs.Put(t, src, id, map[string]any{"v": id})
	}
	waitFor(t, 60*time.Second, "a dead letter for each change and for the refused replication", procs, func() bool {
		recs := list("--limit", "0")
		n := map[string]int{}
		for _, r := range recs {
			n[r.Rule]++
		}
		return n["hook"] == 3 && n["copy"] >= 1
	})

	// list and its filters
	all := list("--limit", "0")
	require.True(t, slices.IsSortedFunc(all, func(a, b dlRecord) int { return int(b.ID) - int(a.ID) }), "newest first")
	hooks := list("--group", "onchange")
	require.Len(t, hooks, 3)
	var ids []string
	for _, r := range hooks {
		assert.Equal(t, "hook", r.Rule)
		assert.Equal(t, src, r.DB)
		assert.NotEmpty(t, r.Seq)
		assert.NotEmpty(t, r.Since)
		assert.Contains(t, r.Error, "500")
		ids = append(ids, r.DocID)
	}
	assert.ElementsMatch(t, docs, ids)
	assert.Len(t, list("--limit", "2"), 2)
	assert.Len(t, list("--before", fmt.Sprint(all[0].ID), "--limit", "0"), len(all)-1, "the next page starts after the id")
	copies := list("--rule", "copy", "--since", "1h")
	require.NotEmpty(t, copies)
	assert.Equal(t, "replicate", copies[0].Group)
	assert.Contains(t, copies[0].Error, "credentials")
	assert.Empty(t, list("--db", "^nothing-like-this$"))
	table := admin(0, "", "deadletters", "list", "--limit", "3")
	assert.Contains(t, table, "ID  ")

	// bad input, and an unconfirmed retry, change nothing
	assert.Contains(t, admin(2, "", "deadletters", "list", "--group", "replicator"), `--group "replicator": unknown group, want replicate or onchange`)
	assert.Contains(t, admin(2, "", "deadletters", "list", "--db", "("), `--db "("`)
	assert.Contains(t, admin(2, "", "deadletters", "list", "--since", "yesterday"), `--since "yesterday"`)
	assert.Contains(t, admin(2, "", "deadletters", "redo"), `unknown command "redo"`)
	assert.Contains(t, admin(1, "", "deadletters", "retry", "--rule", "nope", "--yes"), "no dead letter matches")
	assert.Contains(t, admin(2, "no\n", "deadletters", "retry", "--group", "onchange"), "not confirmed; nothing was re-driven")
	// (the refused replication's jobs may add records of their own meanwhile)
	assert.Len(t, list("--group", "onchange", "--limit", "0"), len(hooks), "the unconfirmed retry re-drove nothing")

	// retry the webhook's records once it answers: every change arrives, the records go
	sink.failing.Store(false)
	out := admin(0, "yes\n", "deadletters", "retry", "--group", "onchange")
	assert.Contains(t, out, "resumed from seq")
	assert.Contains(t, out, "re-drove and deleted 3 dead letters; kept 0")
	waitFor(t, 30*time.Second, "the webhook receives every change again", procs, func() bool {
		for _, id := range docs {
			if sink.delivered(id) == 0 {
				return false
			}
		}
		return true
	})
	assert.Empty(t, list("--group", "onchange"))

	// retry the replication once the target takes the credentials: the target converges
	target.closed.Store(false)
	out = admin(0, "", "deadletters", "retry", "--rule", "copy", "--yes")
	assert.Contains(t, out, "job enqueued, records deleted")
	waitFor(t, 60*time.Second, "the target holds every doc", procs, func() bool {
		return slices.Equal(docIDs(t, cs, tgt), docs)
	})
	assert.Empty(t, list("--rule", "copy"))

	// purge
	sink.failing.Store(true)
	cs.Put(t, src, "d4", map[string]any{"v": "d4"})
	waitFor(t, 60*time.Second, "a dead letter for d4", procs, func() bool { return len(list("--group", "onchange")) == 1 })
	assert.Contains(t, admin(0, "", "deadletters", "purge", "--group", "onchange", "--yes"), "deleted 1 dead letters")
	assert.Empty(t, list("--limit", "0"))
	assert.Contains(t, admin(1, "", "deadletters", "purge", "--yes"), "no dead letter matches the filters: nothing to purge")

	if u, err := url.Parse(cs.URL); err == nil && u.User != nil {
		if pw, ok := u.User.Password(); ok {
			for _, o := range outs {
				assert.NotContains(t, o, pw)
			}
		}
	}
}
