package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/webhook"
)

// webhookHandler returns a handler with two request slots whose POST rule calls url (a
// template) with the given retry policy; retries due after a second are deferred, dead letters
// go to dead.
func webhookHandler(t *testing.T, dead *noDeadLetters, url, retry string) (*handler, *rules.OnChange) {
	t.Helper()
	r, err := rules.Parse("hook", []byte(`{"type":"on_change","url":"`+url+`","method":"POST","retry":`+retry+`}`))
	require.NoError(t, err)
	log := logrus.New()
	log.SetOutput(io.Discard)
	return &handler{
		book: newRetryBook(), requestConcurrency: 2, inlineRetry: time.Second, dead: dead, log: log,
		hooks: webhook.New(webhook.Config{AllowedHosts: []string{"127.0.0.1"}, Timeout: 10 * time.Second}),
	}, r.(*rules.OnChange)
}

// TestWebhookBatchDeferredStopsStarts: without block, a request whose retry is due later
// defers the rule, and no request of the page is started after that, although slots are free;
// done stops before the deferred change, so the checkpoint cannot pass it.
func TestWebhookBatchDeferredStopsStarts(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var mu sync.Mutex
	var seen []string
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := strings.TrimPrefix(r.URL.Path, "/")
		mu.Lock()
		seen = append(seen, id)
		mu.Unlock()
		switch id {
		case "d00":
			w.WriteHeader(http.StatusInternalServerError) // retried in a minute: deferred
		case "d01":
			<-release // holds the other slot, if it took d01, until the deferral is recorded
		}
	}))
	t.Cleanup(sink.Close)
	h, rule := webhookHandler(t, &noDeadLetters{}, sink.URL+"/${change.id}", `{"backoff":"linear","delay_ms":60000,"limit":3}`)

	out := make(chan batchResult, 1)
	go func() { out <- h.processBatch(t.Context(), "db", rule, "", "", rows(10), h.log) }()
	require.Eventually(t, func() bool { return !h.book.empty() }, 10*time.Second, 5*time.Millisecond, "d00 deferred")
	close(release)
	var res batchResult
	select {
	case res = <-out:
	case <-time.After(10 * time.Second):
		t.Fatal("the batch did not end")
	}
	mu.Lock()
	defer mu.Unlock()
	// d01 starts when the second slot's goroutine takes it before d00 is deferred; nothing after it
	// may start.
	assert.Contains(t, seen, "d00")
	assert.Subset(t, []string{"d00", "d01"}, seen, "nothing started after the deferral")
	assert.Equal(t, 0, res.done, "done stops before the deferred change")
	assert.Positive(t, res.retryIn)
	assert.Error(t, res.deferErr)
	assert.NoError(t, res.err)
}

// TestDeferredRequestKeepsItsBackoff: a deferred request is not sent again before its retry is
// due, however often its job runs, and its attempts count towards the rule's limit across runs:
// limit 2 gives three attempts in all, then one dead letter, and the retry book is empty again.
func TestDeferredRequestKeepsItsBackoff(t *testing.T) {
	t.Parallel()
	dead := &noDeadLetters{}
	var mu sync.Mutex
	attempts := 0
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		attempts++
		mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(sink.Close)
	h, rule := webhookHandler(t, dead, sink.URL+"/x", `{"backoff":"linear","delay_ms":60000,"limit":2}`)
	now := time.Now()
	h.book.now = func() time.Time { return now } // a run happens before any other run's retry is due
	sent := func() int { mu.Lock(); defer mu.Unlock(); return attempts }
	run := func() batchResult { return h.processBatch(t.Context(), "db", rule, "", "", rows(1), h.log) }

	for attempt := 1; attempt <= 2; attempt++ {
		res := run()
		assert.Equal(t, attempt, sent(), "attempt %d sent", attempt)
		assert.Zero(t, res.done, "attempt %d: not done", attempt)
		assert.Positive(t, res.retryIn, "attempt %d: deferred", attempt)
		res = run() // the job runs again before the retry is due
		assert.Equal(t, attempt, sent(), "not sent again before its retry is due")
		assert.Positive(t, res.retryIn)
		now = now.Add(10 * time.Minute) // every retry of this policy is due by then
	}
	res := run()
	assert.Equal(t, 3, sent(), "the third attempt is the last (limit 2)")
	assert.Equal(t, 1, res.done, "given up and dead-lettered: done")
	require.Len(t, dead.recs, 1)
	assert.Equal(t, 3, dead.recs[0].Attempts)
	assert.True(t, h.book.empty(), "nothing left in the retry book")
}
