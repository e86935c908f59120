package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

type fakeDBs struct{ err error }

func (f fakeDBs) DBInfo(_ context.Context, db string) (couch.DBInfo, error) {
	if f.err != nil {
		return couch.DBInfo{}, f.err
	}
	return couch.DBInfo{Name: db, UpdateSeq: "42-opaque"}, nil
}

type fakeDeadLetters struct {
	mu   sync.Mutex
	recs []worker.DeadLetter
	err  error
}

func (f *fakeDeadLetters) Publish(_ context.Context, rec worker.DeadLetter) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return f.err
	}
	f.recs = append(f.recs, rec)
	return nil
}

// fakeEngine answers per target db name; it records the bodies it got.
type fakeEngine struct {
	mu      sync.Mutex
	answers map[string]error // by target URL
	calls   []map[string]any
	delay   time.Duration
}

func (f *fakeEngine) Replicate(ctx context.Context, body map[string]any, _ []string) (result, error) {
	f.mu.Lock()
	f.calls = append(f.calls, body)
	err := f.answers[body["target"].(string)]
	f.mu.Unlock()
	if f.delay > 0 {
		select {
		case <-ctx.Done():
			return result{}, &scrubbedError{msg: "timeout", err: ctx.Err()}
		case <-time.After(f.delay):
		}
	}
	if err != nil {
		return result{}, err
	}
	return result{DocsWritten: 1}, nil
}

func (f *fakeEngine) targets() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, b := range f.calls {
		out = append(out, b["target"].(string))
	}
	return out
}

func newTestHandler(t *testing.T, docs map[string]map[string]any) (*replicator, *fakeEngine, *fakeDeadLetters) {
	t.Helper()
	set := rules.NewSet()
	for id, doc := range docs {
		raw, err := json.Marshal(doc)
		require.NoError(t, err)
		_, err = set.Apply(id, raw, false)
		require.NoError(t, err)
	}
	base, _ := url.Parse("http://admin:pw@couch:5984")
	log := logrus.New()
	log.SetOutput(io.Discard)
	eng := &fakeEngine{answers: map[string]error{}}
	dl := &fakeDeadLetters{}
	h := &replicator{
		dbs: fakeDBs{}, rules: set, deadLetters: dl, log: log, base: base, passwords: passwordsFile(t, `{}`),
		engines: map[string]engine{rules.EngineCouchDB: eng}, defaultEngine: rules.EngineCouchDB, timeout: time.Second,
	}
	return h, eng, dl
}

func rule(target string, extra ...any) map[string]any {
	doc := map[string]any{"type": "replicator", "db_name": "^db", "source": "$db_name", "target": target}
	for i := 0; i+1 < len(extra); i += 2 {
		doc[extra[i].(string)] = extra[i+1]
	}
	return doc
}

func tgt(name string) string { return "http://admin:pw@couch:5984/" + name }

func TestHandlerIsolatesRuleFailures(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		answers   map[string]error
		wantErr   bool
		wantDead  []string // rules dead-lettered
		wantCalls int
	}{
		{"all succeed", nil, false, nil, 3},
		{"one permanent: others still run, job acked", map[string]error{tgt("b"): &replicateError{Status: 401, ErrorName: "unauthorized"}}, false, []string{"rb"}, 3},
		{"one transient: others still run, job retried", map[string]error{tgt("a"): &replicateError{Status: 503}}, true, nil, 3},
		{"transient and permanent", map[string]error{tgt("a"): &scrubbedError{msg: "refused", err: errors.New("refused")},
			tgt("c"): &replicateError{Status: 500, ErrorName: "replication_auth_error"}}, true, []string{"rc"}, 3},
		{"db_not_found is retried first", map[string]error{tgt("a"): &replicateError{Status: 500, ErrorName: "db_not_found"}}, true, nil, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a"), "rb": rule("b"), "rc": rule("c")})
			for k, v := range c.answers {
				eng.answers[k] = v
			}
			job := &worker.Job{DB: "db1", Attempt: 2}
			err := h.handle(t.Context(), job)
			if c.wantErr {
				require.Error(t, err)
				assert.False(t, worker.IsPermanent(err))
			} else {
				require.NoError(t, err)
			}
			assert.Len(t, eng.targets(), c.wantCalls)
			var dead []string
			for _, r := range dl.recs {
				dead = append(dead, r.Rule)
				assert.Equal(t, "db1", r.DB)
				assert.NotContains(t, r.Error+r.Details["source"].(string)+r.Details["target"].(string), ":pw@")
			}
			assert.Equal(t, c.wantDead, dead)
		})
	}
}

// TestHandlerAuthFailureRecord: refused credentials are recorded as such in both server shapes:
// PouchDB's 401 and CouchDB 3's 500 replication_auth_error.
func TestHandlerAuthFailureRecord(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name         string
		answer       *replicateError
		serverStatus any
	}{
		{"couchdb 3", &replicateError{Status: 500, ErrorName: "replication_auth_error", Reason: "{session_request_unauthorized,<<\"http://couch:5984/_session\">>,<<\"admin\">>}"}, 500},
		{"401", &replicateError{Status: 401, ErrorName: "unauthorized", Reason: "Name or password is incorrect."}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a")})
			eng.answers[tgt("a")] = c.answer
			require.NoError(t, h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: 1}))
			require.Len(t, dl.recs, 1)
			rec := dl.recs[0]
			assert.Equal(t, 401, rec.Status)
			assert.Equal(t, "credentials refused", rec.Details["cause"])
			assert.Equal(t, c.serverStatus, rec.Details["server_status"])
			assert.Contains(t, rec.Error, "credentials of the source or target refused")
			assert.Contains(t, rec.Error, c.answer.ErrorName)
		})
	}
}

// TestHandlerNativeMissingSource: with only native rules the handler reads no db info; the
// engine's missing source acks the job with a warning, without a retry or a dead letter.
func TestHandlerNativeMissingSource(t *testing.T) {
	t.Parallel()
	h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a", "engine", "native")})
	h.engines[rules.EngineNative] = eng
	h.dbs = failingDBs{t}
	eng.answers[tgt("a")] = fmt.Errorf("%w: source gone", errSourceMissing)
	require.NoError(t, h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: 1}))
	assert.Empty(t, dl.recs)
	assert.Len(t, eng.targets(), 1)
}

// failingDBs fails a test that reads db info.
type failingDBs struct{ t *testing.T }

func (f failingDBs) DBInfo(context.Context, string) (couch.DBInfo, error) {
	f.t.Error("db info read although every rule is native")
	return couch.DBInfo{}, errors.New("unexpected")
}

func TestHandlerDBNotFoundGivenUpAfterAttempts(t *testing.T) {
	t.Parallel()
	h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a")})
	eng.answers[tgt("a")] = &replicateError{Status: 500, ErrorName: "db_not_found", Reason: "could not open http://couch:5984/a/"}
	require.NoError(t, h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: dbNotFoundAttempts}))
	require.Len(t, dl.recs, 1)
	assert.Equal(t, 500, dl.recs[0].Status)
	assert.Contains(t, dl.recs[0].Error, "create_target")
}

func TestHandlerDeadLetterFailureRetriesJob(t *testing.T) {
	t.Parallel()
	h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a")})
	eng.answers[tgt("a")] = &replicateError{Status: 403}
	dl.err = errors.New("nats down")
	err := h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: 1})
	require.Error(t, err)
	assert.False(t, worker.IsPermanent(err))
}

func TestHandlerMissingSourceAcksWithoutReplicating(t *testing.T) {
	t.Parallel()
	h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a")})
	h.dbs = fakeDBs{err: &couch.HTTPError{Status: 404, ErrorName: "not_found"}}
	job := &worker.Job{DB: "db1", Attempt: 1}
	require.NoError(t, h.handle(t.Context(), job))
	assert.Empty(t, eng.targets())
	assert.Empty(t, dl.recs)

	h.dbs = fakeDBs{err: &couch.HTTPError{Status: 503}}
	require.Error(t, h.handle(t.Context(), job), "an unreadable source is transient")
}

func TestHandlerDirtyAfterPostponesFirstDelivery(t *testing.T) {
	t.Parallel()
	h, eng, _ := newTestHandler(t, map[string]map[string]any{
		"ra": rule("a", "dirty_after_milliseconds", 2000), "rb": rule("b", "dirty_after_milliseconds", 500), "rc": rule("c"),
	})
	err := h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: 1})
	require.Error(t, err)
	assert.Equal(t, "retry after 2s", err.Error())
	assert.Empty(t, eng.targets())
	require.NoError(t, h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: 2}))
	assert.Len(t, eng.targets(), 3)
}

func TestHandlerUnavailableEngineAndNoRules(t *testing.T) {
	t.Parallel()
	h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a", "engine", "native"), "rb": rule("b")})
	require.NoError(t, h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: 1}))
	assert.Equal(t, []string{tgt("b")}, eng.targets())
	require.Len(t, dl.recs, 1)
	assert.Equal(t, "ra", dl.recs[0].Rule)
	assert.Equal(t, "engine native is not available in this process", dl.recs[0].Error)

	job := &worker.Job{DB: "other", Attempt: 1}
	require.NoError(t, h.handle(t.Context(), job))
	assert.Len(t, eng.targets(), 1, "no rule matches: nothing runs")
}

func TestHandlerReplicationTimeoutIsTransient(t *testing.T) {
	t.Parallel()
	h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a")})
	eng.delay, h.timeout = 5*time.Second, 50*time.Millisecond
	started := time.Now()
	err := h.handle(t.Context(), &worker.Job{DB: "db1", Attempt: 1})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "timed out after 50ms")
	assert.Less(t, time.Since(started), 4*time.Second)
	assert.Empty(t, dl.recs)
}

// TestHandlerDirtyAfterIsNotAFailedTry: the delivery postponed by dirty_after_milliseconds does
// not count as a failed try: not in the backoff, not towards giving up, not in the dead letter.
func TestHandlerDirtyAfterIsNotAFailedTry(t *testing.T) {
	t.Parallel()
	h, eng, dl := newTestHandler(t, map[string]map[string]any{"ra": rule("a", "dirty_after_milliseconds", 500)})
	eng.answers[tgt("a")] = &replicateError{Status: 500, ErrorName: "db_not_found"}

	first := &worker.Job{DB: "db1", Attempt: 1}
	err := h.handle(t.Context(), first)
	require.Error(t, err)
	assert.Empty(t, eng.targets(), "the first delivery is only the delay")

	second := &worker.Job{DB: "db1", Attempt: 2}
	require.Error(t, h.handle(t.Context(), second))
	assert.Equal(t, 1, second.Tries(), "the first real try")

	almost := &worker.Job{DB: "db1", Attempt: dbNotFoundAttempts}
	require.Error(t, h.handle(t.Context(), almost), "not given up: one delivery was the delay")
	assert.Empty(t, dl.recs)

	last := &worker.Job{DB: "db1", Attempt: dbNotFoundAttempts + 1}
	require.NoError(t, h.handle(t.Context(), last))
	require.Len(t, dl.recs, 1)
	assert.Equal(t, dbNotFoundAttempts, dl.recs[0].Attempts)
}
