package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// fakeStream is a streamPublisher whose answers a test decides: fail(id, n) makes the next n
// publishes of message id fail. It records every publish.
type fakeStream struct {
	mu       sync.Mutex
	failures map[string]int
	sync     []string // message ids, in publish order
}

func (f *fakeStream) fail(id string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failures == nil {
		f.failures = map[string]int{}
	}
	f.failures[id] = n
}

func (f *fakeStream) answer(id string) error {
	if f.failures[id] > 0 {
		f.failures[id]--
		return fmt.Errorf("nats: no response from stream (%s)", id)
	}
	return nil
}

func (f *fakeStream) PublishMsg(_ context.Context, msg *nats.Msg, _ ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := msg.Header.Get(jetstream.MsgIDHeader)
	f.sync = append(f.sync, id)
	if err := f.answer(id); err != nil {
		return nil, err
	}
	return &jetstream.PubAck{Stream: "SPIEGEL_CHANGES"}, nil
}

func (f *fakeStream) StreamNameBySubject(context.Context, string) (string, error) {
	return "SPIEGEL_CHANGES", nil
}

func (f *fakeStream) calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.sync...)
}

type noDeadLetters struct{ recs []worker.DeadLetter }

func (d *noDeadLetters) Publish(_ context.Context, rec worker.DeadLetter) error {
	d.recs = append(d.recs, rec)
	return nil
}

// subjectHandler returns a handler whose subject rules publish into fs.
func subjectHandler(t *testing.T, fs *fakeStream, retry string) (*handler, *rules.OnChange) {
	t.Helper()
	r, err := rules.Parse("pub", []byte(`{"type":"on_change","subject":"spiegel.changes.${db_name}","retry":`+retry+`}`))
	require.NoError(t, err)
	log := logrus.New()
	log.SetOutput(io.Discard)
	return &handler{
		publisher: newChangePublisher(fs, nil, events.NewSubjects("")), dead: &noDeadLetters{}, log: log,
		inlineRetry: time.Second, book: newRetryBook(), requestConcurrency: 10,
	}, r.(*rules.OnChange)
}

const fastRetry = `{"backoff":"linear","delay_ms":1,"limit":3}`

func rows(n int) []couch.Change {
	out := make([]couch.Change, n)
	for i := range out {
		out[i] = couch.Change{Seq: fmt.Sprint(i + 1), ID: fmt.Sprintf("d%02d", i), Revs: []string{"1-a"}, Doc: []byte(`{}`)}
	}
	return out
}

func msgID(i int) string { return fmt.Sprintf("db/d%02d/1-a", i) }

// TestPublishBatchInOrder: a subject rule publishes its page one change at a time in feed order,
// each once.
func TestPublishBatchInOrder(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	h, r := subjectHandler(t, fs, fastRetry)
	res := h.processBatch(t.Context(), "db", r, "", "", rows(50), h.log)
	require.NoError(t, res.err)
	assert.Equal(t, 50, res.done)
	want := make([]string, 50)
	for i := range want {
		want[i] = msgID(i)
	}
	assert.Equal(t, want, fs.calls(), "published once each, in feed order")
}

// TestPublishBatchFailureStopsThePage: a publish refused in the middle of the page is retried
// with the rule's policy before anything after it is sent, so nothing is stored out of order.
func TestPublishBatchFailureStopsThePage(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	fs.fail(msgID(7), 2)
	h, r := subjectHandler(t, fs, fastRetry)
	res := h.processBatch(t.Context(), "db", r, "", "", rows(20), h.log)
	require.NoError(t, res.err)
	assert.Equal(t, 20, res.done)
	var want []string
	for i := range 20 {
		want = append(want, msgID(i))
		if i == 7 {
			want = append(want, msgID(7), msgID(7))
		}
	}
	assert.Equal(t, want, fs.calls())
}

// TestPublishBatchReplay: a replay's messages carry its id in their message ids and the
// Spiegel-Replay header.
func TestPublishBatchReplay(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	h, r := subjectHandler(t, fs, fastRetry)
	res := h.processBatch(t.Context(), "db", r, "", "r1", rows(2), h.log)
	require.NoError(t, res.err)
	assert.Equal(t, []string{"replay/r1/" + msgID(0), "replay/r1/" + msgID(1)}, fs.calls())
	m, err := h.publisher.message("db", r, change{rows(1)[0]}, "r1")
	require.NoError(t, err)
	assert.Equal(t, "r1", m.nats().Header.Get("Spiegel-Replay"))
	m, err = h.publisher.message("db", r, change{rows(1)[0]}, "")
	require.NoError(t, err)
	assert.Empty(t, m.nats().Header.Values("Spiegel-Replay"), "a first publication has no replay header")
}

// TestPublishBatchDeferred: a publish that keeps failing stops the batch at it: done counts the
// changes before it only, so the checkpoint cannot pass it.
func TestPublishBatchDeferred(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	fs.fail(msgID(4), 1000)
	h, r := subjectHandler(t, fs, `{"backoff":"linear","delay_ms":60000,"limit":0}`) // retries due later: the rule defers
	res := h.processBatch(t.Context(), "db", r, "", "", rows(10), h.log)
	assert.Equal(t, 4, res.done)
	assert.Positive(t, res.retryIn)
	assert.Error(t, res.deferErr)
}

// TestPublishBatchCancelled: a batch cut short by its context reports the changes whose answers
// came back, no more.
func TestPublishBatchCancelled(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	h, r := subjectHandler(t, fs, fastRetry)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	res := h.processBatch(ctx, "db", r, "", "", rows(10), h.log)
	assert.Equal(t, 0, res.done)
	assert.True(t, errors.Is(res.err, context.Canceled), "%v", res.err)
}

// TestExpiringSetBounded: the publisher's sets never hold more than their cap, however many
// subjects (dbs) go through them; expired entries go first, and an entry is found only until it
// expires.
func TestExpiringSetBounded(t *testing.T) {
	t.Parallel()
	now := time.Unix(0, 0)
	s := newExpiringSet(time.Minute, 100)
	s.now = func() time.Time { return now }
	for i := range 50 {
		s.add(fmt.Sprint("old", i))
	}
	now = now.Add(2 * time.Minute)
	for i := range 50 {
		s.add(fmt.Sprint("new", i))
	}
	assert.False(t, s.has("old1"), "expired")
	assert.True(t, s.has("new1"))
	s.add("one more") // full: the expired entries go, the live ones stay
	assert.Equal(t, 51, s.len())
	assert.True(t, s.has("new49"))
	for i := range 20_000 {
		s.add(fmt.Sprint("db", i))
		require.LessOrEqual(t, s.len(), 100)
	}
	assert.True(t, s.has("db19999"), "the newest entry is kept")
}
