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
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// fakeStream is a streamPublisher whose answers a test decides: fail(id, n) makes the next n
// publishes of message id fail (async and sync alike). Async answers arrive in reverse order of
// the publishes, so that waiting "in order" is exercised. It records every publish.
type fakeStream struct {
	mu       sync.Mutex
	failures map[string]int
	async    []string // message ids, in publish order
	sync     []string
	futures  []*fakeFuture
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

func (f *fakeStream) PublishMsgAsync(msg *nats.Msg, _ ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := msg.Header.Get(jetstream.MsgIDHeader)
	f.async = append(f.async, id)
	fut := &fakeFuture{msg: msg, ok: make(chan *jetstream.PubAck, 1), err: make(chan error, 1), answer: f.answer(id)}
	f.futures = append(f.futures, fut)
	return fut, nil
}

// settle answers every future so far, newest first.
func (f *fakeStream) settle() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := len(f.futures) - 1; i >= 0; i-- {
		f.futures[i].resolve()
	}
	f.futures = nil
}

func (f *fakeStream) StreamNameBySubject(context.Context, string) (string, error) {
	return "SPIEGEL_CHANGES", nil
}

func (f *fakeStream) calls() (async, sync []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.async...), append([]string(nil), f.sync...)
}

type fakeFuture struct {
	msg    *nats.Msg
	ok     chan *jetstream.PubAck
	err    chan error
	answer error
	once   sync.Once
}

func (f *fakeFuture) resolve() {
	f.once.Do(func() {
		if f.answer != nil {
			f.err <- f.answer
			return
		}
		f.ok <- &jetstream.PubAck{Stream: "SPIEGEL_CHANGES"}
	})
}
func (f *fakeFuture) Ok() <-chan *jetstream.PubAck { return f.ok }
func (f *fakeFuture) Err() <-chan error            { return f.err }
func (f *fakeFuture) Msg() *nats.Msg               { return f.msg }

type noDeadLetters struct{ recs []worker.DeadLetter }

func (d *noDeadLetters) Publish(_ context.Context, rec worker.DeadLetter) error {
	d.recs = append(d.recs, rec)
	return nil
}

// subjectHandler returns a handler whose subject rules publish into fs; futures are answered
// (newest first) as soon as they are waited for.
func subjectHandler(t *testing.T, fs *fakeStream, retry string) (*handler, *rules.OnChange) {
	t.Helper()
	r, err := rules.Parse("pub", []byte(`{"type":"on_change","subject":"spiegel.changes.${db_name}","retry":`+retry+`}`))
	require.NoError(t, err)
	log := logrus.New()
	log.SetOutput(io.Discard)
	return &handler{
		publisher: newChangePublisher(fs, nil), dead: &noDeadLetters{}, log: log,
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

// runSettling runs processBatch while answering the fake's futures as they come.
func runSettling(t *testing.T, h *handler, r *rules.OnChange, fs *fakeStream, ctx context.Context, n int) batchResult {
	t.Helper()
	done := make(chan batchResult, 1)
	go func() { done <- h.processBatch(ctx, "db", r, "", rows(n), h.log) }()
	for {
		select {
		case res := <-done:
			return res
		case <-time.After(time.Millisecond):
			fs.settle()
		}
	}
}

// TestPublishBatchPipelined: a subject rule publishes its page asynchronously in feed order and
// is done only when every answer came back, whatever order the answers arrive in.
func TestPublishBatchPipelined(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	h, r := subjectHandler(t, fs, fastRetry)
	res := runSettling(t, h, r, fs, t.Context(), 50)
	require.NoError(t, res.err)
	assert.Equal(t, 50, res.done)
	async, sync := fs.calls()
	want := make([]string, 50)
	for i := range want {
		want[i] = msgID(i)
	}
	assert.Equal(t, want, async, "published once each, in feed order")
	assert.Empty(t, sync)
}

// TestPublishBatchFailureRetriedAlone: a publish refused in the middle of the pipeline is
// retried alone with the rule's policy; the pipeline resumes after it, and nothing is lost.
func TestPublishBatchFailureRetriedAlone(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	fs.fail(msgID(7), 2) // the async publish and the first synchronous retry
	h, r := subjectHandler(t, fs, fastRetry)
	res := runSettling(t, h, r, fs, t.Context(), 20)
	require.NoError(t, res.err)
	assert.Equal(t, 20, res.done)
	async, sync := fs.calls()
	assert.Equal(t, []string{msgID(7), msgID(7)}, sync, "the failed change alone, until it succeeds")
	assert.Equal(t, 20+12, len(async), "the pipeline resumes after the failed change")
	assert.Equal(t, msgID(8), async[20])
}

// TestPublishBatchDeferred: a publish that keeps failing stops the batch at it: done counts the
// changes before it only, so the checkpoint cannot pass it.
func TestPublishBatchDeferred(t *testing.T) {
	t.Parallel()
	fs := &fakeStream{}
	fs.fail(msgID(4), 1000)
	h, r := subjectHandler(t, fs, `{"backoff":"linear","delay_ms":60000,"limit":0}`) // retries due later: the rule defers
	res := runSettling(t, h, r, fs, t.Context(), 10)
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
	res := h.processBatch(ctx, "db", r, "", rows(10), h.log)
	assert.Equal(t, 0, res.done)
	assert.True(t, errors.Is(res.err, context.Canceled), "%v", res.err)
}
