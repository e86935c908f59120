package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// The change stream's order is tested with a real nats-server and the faults a real server
// produces: a publish the stream refuses in the middle of a page (a message over the stream's
// max_msg_size until the operator raises it — the same shape as a publish lost in a stream leader
// election: one refused, the ones after it accepted) and a NATS restart in the middle of a page.

// orderStream creates stream CHG on chg.> (max_msg_size maxMsg; atomic batch publishes allowed
// if atomic) and returns the JetStream handle of a connection that reconnects forever.
func orderStream(t testing.TB, s *natstest.Server, maxMsg int32, atomic bool) jetstream.JetStream {
	t.Helper()
	_, js := s.Connect(t)
	_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "CHG_CHANGES", Subjects: []string{"chg.>"},
		MaxMsgSize: maxMsg, Duplicates: time.Hour, Storage: jetstream.FileStorage, AllowAtomicPublish: atomic})
	require.NoError(t, err)
	return js
}

// countingPublisher counts the one-at-a-time publishes and those that failed.
type countingPublisher struct {
	jetstream.JetStream
	calls, failed atomic.Int64
}

func (c *countingPublisher) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	c.calls.Add(1)
	ack, err := c.JetStream.PublishMsg(ctx, m, opts...)
	if err != nil {
		c.failed.Add(1)
	}
	return ack, err
}

// orderHandler returns a handler whose subject rule publishes to chg.${db_name} through pub,
// retrying every 20 ms without limit; it publishes atomic pages whenever the stream allows them
// (the embedded server's streams have one replica).
func orderHandler(t testing.TB, pub streamPublisher) (*handler, *rules.OnChange) {
	t.Helper()
	r, err := rules.Parse("pub", []byte(`{"type":"on_change","subject":"chg.changes.${db_name}","timeout_ms":2000,"retry":{"backoff":"linear","delay_ms":20,"limit":0}}`))
	require.NoError(t, err)
	log := logrus.New()
	log.SetOutput(io.Discard)
	p := newChangePublisher(pub, nil, events.NewSubjects("chg"))
	p.atomicOnFile = true
	return &handler{publisher: p, dead: &noDeadLetters{}, log: log,
		inlineRetry: time.Minute, book: newRetryBook(), requestConcurrency: 10}, r.(*rules.OnChange)
}

// pageRows returns n changes of db "db"; the one at big has a doc of 2 KB.
func pageRows(n, big int) []couch.Change {
	out := make([]couch.Change, n)
	for i := range out {
		doc := `{"n":` + fmt.Sprint(i) + `}`
		if i == big {
			doc = `{"pad":"` + strings.Repeat("x", 2048) + `"}`
		}
		out[i] = couch.Change{Seq: fmt.Sprint(i + 1), ID: fmt.Sprintf("d%03d", i), Revs: []string{"1-a"}, Doc: []byte(doc)}
	}
	return out
}

// stored returns the message ids stream CHG holds, in stream order.
func stored(t testing.TB, js jetstream.JetStream) []string {
	t.Helper()
	st, err := js.Stream(t.Context(), "CHG_CHANGES")
	require.NoError(t, err)
	info, err := st.Info(t.Context())
	require.NoError(t, err)
	var ids []string
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(t.Context(), seq)
		require.NoError(t, err)
		ids = append(ids, m.Header.Get(jetstream.MsgIDHeader))
	}
	return ids
}

func storedCount(t testing.TB, js jetstream.JetStream) uint64 {
	st, err := js.Stream(t.Context(), "CHG_CHANGES")
	require.NoError(t, err)
	info, err := st.Info(t.Context())
	require.NoError(t, err)
	return info.State.Msgs
}

func wantIDs(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("db/d%03d/1-a", i)
	}
	return out
}

// publishModes are the ways a page is published: one change at a time, or as an atomic batch
// when the stream allows it (then one at a time when the batch was refused).
var publishModes = []struct {
	name   string
	atomic bool
}{{"one at a time", false}, {"atomic batch", true}}

// runPage runs h's rule on rows in the background, once the subject was checked (as a job does
// before each page).
func runPage(t testing.TB, h *handler, r *rules.OnChange, rows []couch.Change) <-chan batchResult {
	t.Helper()
	ok, err := h.publisher.check(t.Context(), "db", r, h.dead, h.log)
	require.NoError(t, err)
	require.True(t, ok)
	done := make(chan batchResult, 1)
	go func() { done <- h.processBatch(t.Context(), "db", r, "", "", rows, h.log) }()
	return done
}

// TestPublishOrderThroughARefusedPublish: the stream refuses one publish in the middle of a page
// until the operator raises its max_msg_size. Nothing after it is stored before it: the stream
// ends up holding the page in feed order, each change once. (Pipelined publishes, the way pages
// were published before, store the changes after it first: see TestPipelinedPublishBreaksOrder.)
func TestPublishOrderThroughARefusedPublish(t *testing.T) {
	t.Parallel()
	for _, mode := range publishModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			const n, big = 20, 7
			s := natstest.Start(t)
			js := orderStream(t, s, 1024, mode.atomic)
			pub := &countingPublisher{JetStream: js}
			h, r := orderHandler(t, pub)
			done := runPage(t, h, r, pageRows(n, big))
			require.Eventually(t, func() bool { return pub.failed.Load() >= 3 }, 10*time.Second, 5*time.Millisecond, "the big change is refused and retried")
			assert.Equal(t, wantIDs(big), stored(t, js), "nothing after the refused change is stored")
			raiseMaxMsg(t, js)
			res := <-done
			require.NoError(t, res.err)
			assert.Equal(t, n, res.done)
			assert.Equal(t, wantIDs(n), stored(t, js), "feed order, each once")
		})
	}
}

// TestPipelinedPublishBreaksOrder shows the fault of TestPublishOrderThroughARefusedPublish
// breaking the order of pipelined publishes (the baseline of BenchmarkPublishPage).
func TestPipelinedPublishBreaksOrder(t *testing.T) {
	t.Parallel()
	const n, big = 20, 7
	s := natstest.Start(t)
	js := orderStream(t, s, 1024, false)
	done := make(chan struct{})
	go func() { defer close(done); publishPipelinedUntilStored(t, js, pageRows(n, big)) }()
	require.Eventually(t, func() bool { return storedCount(t, js) == n-1 }, 10*time.Second, 5*time.Millisecond)
	raiseMaxMsg(t, js)
	<-done
	ids := stored(t, js)
	require.Len(t, ids, n)
	assert.Equal(t, fmt.Sprintf("db/d%03d/1-a", big), ids[n-1], "the refused change is stored last, after the ones that follow it")
}

func raiseMaxMsg(t testing.TB, js jetstream.JetStream) {
	t.Helper()
	st, err := js.Stream(t.Context(), "CHG_CHANGES")
	require.NoError(t, err)
	cfg := st.CachedInfo().Config
	cfg.MaxMsgSize = 1 << 20
	_, err = js.UpdateStream(t.Context(), cfg)
	require.NoError(t, err)
}

// TestPublishOrderThroughANATSRestart: NATS restarts (same store) while a page of 300 changes
// is being published; the stream holds them in feed order, each once.
func TestPublishOrderThroughANATSRestart(t *testing.T) {
	t.Parallel()
	for _, mode := range publishModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			const n = 300
			s := natstest.Start(t)
			js := orderStream(t, s, 0, mode.atomic)
			pub := &countingPublisher{JetStream: js}
			h, r := orderHandler(t, pub)
			rows := pageRows(n, -1)
			first := runPage(t, h, r, rows[:100])
			require.NoError(t, (<-first).err)
			assert.Equal(t, mode.atomic, pub.calls.Load() == 0, "%d changes published one at a time", pub.calls.Load())
			done := runPage(t, h, r, rows[100:])
			s.Restart(t)
			res := <-done
			require.NoError(t, res.err)
			assert.Equal(t, n-100, res.done)
			assert.Equal(t, wantIDs(n), stored(t, js), "feed order, each once")
		})
	}
}

// publishPipelined is how a page was published before strict order: every publish sent at once on
// one connection, the answers awaited in order. It returns the index of the first that failed
// (len(msgs) when none did) and its error.
func publishPipelined(ctx context.Context, js jetstream.JetStream, msgs []*nats.Msg, timeout time.Duration) (int, error) {
	futures := make([]jetstream.PubAckFuture, 0, len(msgs))
	for i, m := range msgs {
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			return i, err
		}
		futures = append(futures, f)
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for i, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return i, err
		case <-timer.C:
			return i, fmt.Errorf("no answer within %s", timeout)
		case <-ctx.Done():
			return i, ctx.Err()
		}
	}
	return len(msgs), nil
}

// publishPipelinedUntilStored publishes rows as the pipelined publisher did: the page at once,
// then a failed change retried alone until stored, then the rest of the page pipelined again.
func publishPipelinedUntilStored(t testing.TB, js jetstream.JetStream, rows []couch.Change) {
	p := newChangePublisher(js, nil, events.NewSubjects("chg"))
	r, err := rules.Parse("pub", []byte(`{"type":"on_change","subject":"chg.changes.${db_name}"}`))
	require.NoError(t, err)
	msgs := make([]*nats.Msg, len(rows))
	for i, c := range rows {
		m, err := p.message("db", r.(*rules.OnChange), change{c}, "")
		require.NoError(t, err)
		msgs[i] = m.nats()
	}
	for from := 0; from < len(msgs); {
		failed, err := publishPipelined(t.Context(), js, msgs[from:], 5*time.Second)
		if err == nil {
			break
		}
		failed += from
		for { // each attempt is a round trip the stream answers at once
			if _, err := js.PublishMsg(t.Context(), msgs[failed]); err == nil {
				break
			}
		}
		from = failed + 1
	}
}

// BenchmarkPublishPage compares, in one run, the publish throughput of a subject rule's page
// (100 changes, embedded nats-server, file storage, one replica) published strictly in order and
// fenced (see fence.go) — in pipelined windows, or as one atomic batch — and plainly pipelined
// (all at once, answers awaited in order: the earlier way, which cannot keep the order through a
// refused publish). Each way has a stream of its own. Each iteration publishes one page each way,
// in turn, so that a busy machine slows all three alike; the figures are changes/s and the ratios
// to pipelined. A single-replica file stream stages an atomic batch in a file of its own, the case
// where the consumer publishes windows instead (takesAtomicPages); a replicated stream stages it
// in memory.
func BenchmarkPublishPage(b *testing.B) {
	const page = 100
	s := natstest.Start(b)
	js := orderStream(b, s, 0, false)
	_, err := js.CreateStream(b.Context(), jetstream.StreamConfig{Name: "ATOM", Subjects: []string{"atom.>"},
		Duplicates: time.Hour, Storage: jetstream.FileStorage, AllowAtomicPublish: true})
	require.NoError(b, err)
	_, err = js.CreateStream(b.Context(), jetstream.StreamConfig{Name: "PIPE", Subjects: []string{"pipe.>"},
		Duplicates: time.Hour, Storage: jetstream.FileStorage})
	require.NoError(b, err)
	oneByOne, oneRule := orderHandler(b, js)
	atomic, _ := orderHandler(b, js)
	r, err := rules.Parse("atom", []byte(`{"type":"on_change","subject":"atom.${db_name}","timeout_ms":2000}`))
	require.NoError(b, err)
	atomicRule := r.(*rules.OnChange)
	for _, x := range []struct {
		h *handler
		r *rules.OnChange
	}{{oneByOne, oneRule}, {atomic, atomicRule}} {
		ok, err := x.h.publisher.check(b.Context(), "db", x.r, x.h.dead, x.h.log)
		require.NoError(b, err)
		require.True(b, ok)
	}
	require.False(b, oneByOne.publisher.takesAtomic("chg.changes.db"))
	require.True(b, atomic.publisher.takesAtomic("atom.db"))
	rows := pageRows(page, -1)
	renamed := func(prefix string, i int) []couch.Change { // new message ids: no deduplication
		out := slices.Clone(rows)
		for j := range out {
			out[j].ID = fmt.Sprintf("%s-%d-%d", prefix, i, j)
		}
		return out
	}
	// One job each: the fence's read of the subject happens once, as in a job with many pages.
	oneCtx, atomicCtx := withFences(b.Context()), withFences(b.Context())
	var tOne, tAtomic, tPipe time.Duration
	b.ResetTimer()
	for i := range b.N {
		for _, x := range []struct {
			name string
			ctx  context.Context
			h    *handler
			r    *rules.OnChange
			t    *time.Duration
		}{{"one", oneCtx, oneByOne, oneRule, &tOne}, {"atomic", atomicCtx, atomic, atomicRule, &tAtomic}} {
			page := renamed(x.name, i)
			start := time.Now()
			res := x.h.processBatch(x.ctx, "db", x.r, "", "", page, x.h.log)
			*x.t += time.Since(start)
			if res.err != nil || res.done != len(page) {
				b.Fatalf("%s page %d: %d done, %v", x.name, i, res.done, res.err)
			}
		}
		msgs := make([]*nats.Msg, page)
		for j, c := range renamed("pipelined", i) {
			m, err := oneByOne.publisher.message("db", oneRule, change{c}, "")
			if err != nil {
				b.Fatal(err)
			}
			m.subject = "pipe.db" // a stream of its own, as the others have
			msgs[j] = m.nats()
		}
		start := time.Now()
		if n, err := publishPipelined(b.Context(), js, msgs, 5*time.Second); err != nil {
			b.Fatalf("pipelined page %d: %d done, %v", i, n, err)
		}
		tPipe += time.Since(start)
	}
	rate := func(d time.Duration) float64 { return float64(b.N*page) / d.Seconds() }
	b.ReportMetric(rate(tOne), "windowed-changes/s")
	b.ReportMetric(rate(tAtomic), "atomic-batch-changes/s")
	b.ReportMetric(rate(tPipe), "pipelined-changes/s")
	b.ReportMetric(tPipe.Seconds()/tOne.Seconds(), "windowed/pipelined")
	b.ReportMetric(tPipe.Seconds()/tAtomic.Seconds(), "atomic-batch/pipelined")
}
