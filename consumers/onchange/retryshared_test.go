package main

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestDeferredRequestGoesOnInAnotherInstance: a webhook request fails and is deferred to a retry
// due in 12 s; the instance that ran it stops, and another runs the job. The request's attempt
// count and backoff come with the rule's checkpoint: the second instance does not send it before
// its retry is due, and its one retry (limit 1) is the last: two attempts in all, then a dead
// letter. Before, the retry book was per process: the second instance started over, sending the
// request at once and then once more after its own backoff (three attempts, limit 1).
func TestDeferredRequestGoesOnInAnotherInstance(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	var sent atomic.Int32
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		sent.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(sink.Close)
	_, stopA := e.startStoppable(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.putRule(t, "hook", map[string]any{"db_name": only(db), "url": sink.URL + "/x", "method": "POST",
		"retry": map[string]any{"backoff": "linear", "delay_ms": 12000, "limit": 1}})
	e.Couch.Put(t, db, "a", map[string]any{"v": 1})
	require.Eventually(t, func() bool {
		e.enqueue(t, db)
		cp, err := e.onChangeStore(t).Load(t.Context(), "hook", db)
		return err == nil && len(cp.Retries) == 1 && cp.Retries[0].Attempts == 1
	}, 30*time.Second, 200*time.Millisecond, "the deferred request is kept with the checkpoint")
	require.Equal(t, int32(1), sent.Load())
	deferredAt := time.Now()
	stopA()

	e.startStoppable(t)
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return len(e.deadLettersOf(t, db)) == 1 }, 60*time.Second, 100*time.Millisecond,
		"the request is given up at its limit")
	assert.Equal(t, int32(2), sent.Load(), "two attempts in all (limit 1): the second instance went on with the first's count")
	assert.GreaterOrEqual(t, time.Since(deferredAt), 10*time.Second, "and waited for its retry")
	assert.Equal(t, 2, e.deadLettersOf(t, db)[0].Attempts)
}
