package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
)

// ruleURL returns the URL of db on the test server for a rule: with the server's user but never
// its password (rules may not hold one), and a passwords file content supplying it.
func (e *env) ruleURL(t *testing.T, db string) (string, string) {
	t.Helper()
	u, err := url.Parse(e.Couch.URL)
	require.NoError(t, err)
	file := "{}"
	if u.User != nil {
		pw, _ := u.User.Password()
		file = fmt.Sprintf(`{%q: {%q: %q}}`, u.Host, u.User.Username(), pw)
		u.User = url.User(u.User.Username())
	}
	return strings.TrimRight(u.String(), "/") + "/" + escapeDBName(db), file
}

func writePasswords(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "passwords.json")
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	return path
}

// An exact rule added to a running replicator replicates the data already in the source when
// its job comes (the producer enqueues every matching db of a new rule); later writes follow.
func TestExactRuleReplicatesExistingDataThenWrites(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	db1, db2 := e.Prefix+"db1", e.Prefix+"db2"
	e.Couch.CreateDB(t, db1)
	e.Couch.CreateDB(t, db2)
	for i := range 3 {
		e.Couch.Put(t, db1, fmt.Sprintf("old%d", i), map[string]any{"i": i})
	}
	p := e.startReplicator(t, nil)
	e.Couch.Put(t, e.cfg.DBName, "exact", map[string]any{"type": "replicator", "source": db1, "target": db2})
	p.waitRule(t, db1)
	e.publish(t, db1)
	waitConverged(t, e.Couch, db1, db2, 20*time.Second)

	e.Couch.Put(t, db1, "new", map[string]any{"fresh": true})
	e.publish(t, db1)
	waitConverged(t, e.Couch, db1, db2, 20*time.Second)
	assert.Len(t, revs(t, e.Couch, db2), 4)
	assert.Contains(t, e.Logs.String(), `"rule":"exact"`)
	// The target holds the doc before the server answers _replicate: wait for the log line.
	require.Eventually(t, func() bool { return strings.Contains(e.Logs.String(), `"docs_written":1`) },
		10*time.Second, 20*time.Millisecond, "the run that wrote the new doc logs docs_written 1")
}

// Names with '+', '$', '(', ')' (and '/' on CouchDB) replicate, through bare-name and URL rules.
func TestSpecialDBNames(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	names := []string{e.Prefix + "ab+c$d(e)-f_g"}
	if !e.Couch.PouchDB { // PouchDB Server cannot serve names with '/'
		names = append(names, e.Prefix+"a/b+c$d")
	}
	var files []string
	for i, db := range names {
		e.Couch.CreateDB(t, db)
		e.Couch.CreateDB(t, db+"_copy")
		e.Couch.Put(t, db, "doc", map[string]any{"i": i})
		e.Couch.Put(t, e.cfg.DBName, fmt.Sprintf("bare%d", i), map[string]any{
			"type": "replicator", "db_name": "^" + strings.NewReplacer("+", `\+`, "$", `\$`, "(", `\(`, ")", `\)`).Replace(db) + "$",
			"source": "$db_name", "target": "${db_name}_copy",
		})
		src, file := e.ruleURL(t, db)
		tgt, _ := e.ruleURL(t, db+"_url")
		files = append(files, file)
		e.Couch.CreateDB(t, db+"_url")
		e.Couch.Put(t, e.cfg.DBName, fmt.Sprintf("url%d", i), map[string]any{"type": "replicator", "source": src, "target": tgt})
	}
	cfg := e.cfg
	cfg.PasswordsFile = writePasswords(t, files[0])
	p := e.startReplicator(t, &cfg)
	for _, db := range names {
		p.waitRule(t, db)
		require.Eventually(t, func() bool { return len(p.app.Rules.Replicators(db)) == 2 }, 10*time.Second, 20*time.Millisecond)
		e.publish(t, db)
	}
	for _, db := range names {
		waitConverged(t, e.Couch, db, db+"_copy", 20*time.Second)
		waitConverged(t, e.Couch, db, db+"_url", 20*time.Second)
	}
}

// recorder is an HTTP proxy in front of the test server that keeps the bodies of
// POST /_replicate.
type recorder struct {
	mu     sync.Mutex
	bodies []map[string]any
}

func (e *env) recordingProxy(t *testing.T) (*recorder, string) {
	t.Helper()
	target, err := url.Parse(e.Couch.URL)
	require.NoError(t, err)
	rec := &recorder{}
	rp := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: target.Scheme, Host: target.Host, Path: target.Path})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/_replicate" {
			data, _ := io.ReadAll(r.Body)
			var body map[string]any
			_ = json.Unmarshal(data, &body)
			rec.mu.Lock()
			rec.bodies = append(rec.bodies, body)
			rec.mu.Unlock()
			r.Body = io.NopCloser(bytes.NewReader(data))
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	u.User = target.User
	return rec, u.String()
}

// The passwords file supplies the password of a source URL's user: the request carries it, the
// server accepts it, a wrong one is dead-lettered naming the rule, and no log line, error or
// dead letter holds a password.
func TestPasswordsInjectedNeverLogged(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	const user, secret, wrong = "alice", "Sup3r-S3cret-Pw", "Wr0ng-S3cret-Pw"
	userName := e.Prefix + user
	require.NoError(t, e.Couch.Do(t, http.MethodPut, "/_users/org.couchdb.user:"+userName,
		map[string]any{"name": userName, "password": secret, "roles": []string{}, "type": "user"}, nil))
	t.Cleanup(func() {
		var doc struct {
			Rev string `json:"_rev"`
		}
		if e.Couch.Do(t, http.MethodGet, "/_users/org.couchdb.user:"+userName, nil, &doc) == nil {
			_ = e.Couch.Do(t, http.MethodDelete, "/_users/org.couchdb.user:"+userName+"?rev="+doc.Rev, nil, nil)
		}
	})
	src, tgt, bad := e.Prefix+"src", e.Prefix+"tgt", e.Prefix+"bad_tgt"
	for _, db := range []string{src, tgt, bad} {
		e.Couch.CreateDB(t, db)
	}
	if !e.Couch.PouchDB {
		require.NoError(t, e.Couch.Do(t, http.MethodPut, "/"+escapeDBName(src)+"/_security",
			map[string]any{"members": map[string]any{"names": []string{userName}}}, nil))
	}
	e.Couch.Put(t, src, "doc", map[string]any{"x": 1})

	srv, _ := url.Parse(e.Couch.URL)
	userURL := fmt.Sprintf("%s://%s@%s/%s", srv.Scheme, userName, srv.Host, escapeDBName(src))
	otherUser := e.Prefix + "mallory"
	badURL := fmt.Sprintf("%s://%s@%s/%s", srv.Scheme, otherUser, srv.Host, escapeDBName(src))
	e.Couch.Put(t, e.cfg.DBName, "good", map[string]any{"type": "replicator", "source": userURL, "target": tgt})
	e.Couch.Put(t, e.cfg.DBName, "wrongpw", map[string]any{"type": "replicator", "source": badURL, "target": bad, "db_name": "^" + src + "$"})

	rec, proxyURL := e.recordingProxy(t)
	cfg := e.cfg
	cfg.CouchDBURL = proxyURL
	cfg.PasswordsFile = writePasswords(t, fmt.Sprintf(`{%q: {%q: %q, %q: %q}}`, srv.Hostname(), userName, secret, otherUser, wrong))
	p := e.startReplicator(t, &cfg)
	require.Eventually(t, func() bool { return len(p.app.Rules.Replicators(src)) == 2 }, 15*time.Second, 20*time.Millisecond)
	e.publish(t, src)
	waitConverged(t, e.Couch, src, tgt, 20*time.Second)
	var dead []string
	require.Eventually(t, func() bool { dead = e.deadLetters(t); return len(dead) == 1 }, 15*time.Second, 100*time.Millisecond)

	rec.mu.Lock()
	var sources []string
	for _, b := range rec.bodies {
		sources = append(sources, fmt.Sprint(b["source"]))
	}
	rec.mu.Unlock()
	assert.Contains(t, sources, fmt.Sprintf("%s://%s:%s@%s/%s", srv.Scheme, userName, secret, srv.Host, escapeDBName(src)))
	assert.Contains(t, dead[0], `"rule":"wrongpw"`)
	assert.Contains(t, dead[0], `"status":401`)

	e.waitQuiet(t, p, 10*time.Second)
	logs := e.Logs.String()
	assert.Contains(t, logs, `"rule":"wrongpw"`)
	secrets := []string{secret, wrong}
	if pw, ok := srv.User.Password(); ok {
		secrets = append(secrets, pw)
	}
	for _, s := range secrets {
		assert.NotContains(t, logs, s, "a log line holds a password")
		assert.NotContains(t, dead[0], s, "the dead letter holds a password")
	}
}

// An unreachable target is retried with backoff, never in a tight loop, and not dead-lettered.
func TestUnreachableTargetBacksOff(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 10*time.Second)
	src := e.Prefix + "src"
	e.Couch.CreateDB(t, src)
	e.Couch.Put(t, src, "doc", map[string]any{"x": 1})
	e.Couch.Put(t, e.cfg.DBName, "down", map[string]any{"type": "replicator", "source": src, "target": "http://127.0.0.1:1/nowhere"})
	p := e.startReplicator(t, nil)
	p.waitRule(t, src)
	e.publish(t, src)
	// The job is redelivered after the runner's backoff for its attempt (RetryInitial 1s,
	// doubling, up to 20% jitter taken off), counted from the end of the failed run: CouchDB's
	// _replicate itself may spend seconds on an unreachable target before it answers.
	var runs []handlerRun
	require.Eventually(t, func() bool { runs = p.runsOf(src); return len(runs) >= 3 }, 60*time.Second, 50*time.Millisecond)
	policy := backoff.Policy{Initial: e.cfg.RetryInitial, Max: e.cfg.RetryMax, Multiplier: 2}
	for i, r := range runs[:3] {
		assert.Equal(t, i+1, r.attempt, "delivery count of run %d", i+1)
		if i > 0 {
			gap, least := r.start.Sub(runs[i-1].end), policy.Delay(i)*8/10
			assert.GreaterOrEqual(t, gap, least, "run %d started %s after run %d ended; the backoff is at least %s", i+1, gap, i, least)
		}
	}
	assert.Len(t, p.replications(src), len(p.runsOf(src)), "one replication per run")
	assert.Empty(t, e.deadLetters(t))
	assert.Equal(t, uint64(1), e.WorkMsgs(t), "the job is kept for a retry")
}
