package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/webhook"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// Fenced change streams.
//
// A job's lease ends before JetStream can hand the job to another instance (worker.Held), and an
// instance that lost it sends nothing more. What it sent before may still be on its way, though:
// a NATS connection that froze holds the bytes, and they reach the server when it thaws, after
// the next holder of the job published newer changes. A late message of an older revision stored
// after a newer one breaks the order a service rebuilds its state from. So for a rule whose
// subject is its db's own (the subject holds ${db_name}) the stream itself refuses late messages:
// every publish, or atomic batch, expects the subject's last sequence to be the one the job
// knows (Nats-Expected-Last-Subject-Sequence): read at the stream leader when the job first
// publishes to the subject, then moved by each publish the stream confirmed. A message is thus
// stored only right after one its publisher knew of. A late message of an instance that lost the
// job is refused once the next holder stored anything; if it comes first, it is in feed order, and
// the next holder's own publish is refused instead: its job ends (errFenced) and runs again from
// its checkpoint, reading the subject afresh, its republished changes deduplicated by message id.
//
// A publish that the stream answers as a duplicate does not move what the job knows, even when
// the stored copy is newer: the job cannot tell its own earlier attempt (an answer lost) from
// another instance's publish, so its next new change is refused if anything was stored since and
// the job runs again. That costs a rerun after a lost answer, never the order.
//
// A subject without ${db_name} is shared by the jobs of every db the rule matches, which publish at
// once: it cannot be fenced that way. Its pages keep their feed order within one holder, as
// before; consumers/onchange/README.md says so.

// errFenced: the stream refused a publish because the subject's last message is not the one the
// job knew of.
var errFenced = errors.New("the subject's stream holds a message this job did not know of " +
	"(another instance published to the subject since: a newer holder of the job, or another rule or process using it); " +
	"the job stops and runs again from its checkpoint")

// errBatchDuplicate: an atomic batch holds a change the stream has already; nothing of the batch
// was stored.
var errBatchDuplicate = errors.New("the batch holds a change the stream has already")

// fence is what a job knows of a fenced subject: the sequence of the subject's last message.
// mu is held for a whole page, so that the rules of a job that share a subject publish one page
// at a time.
type fence struct {
	mu   sync.Mutex
	read bool   // last was read from the stream
	last uint64 // 0: the subject holds no message
	// stored is the highest sequence the stream answered for a change this job published, an
	// answer "duplicate" included: the message holding the change is there even when the job
	// cannot tell who stored it (its own earlier attempt, whose answer was lost, or another
	// instance). The checkpoint's stream point is the higher of last and stored, so that a
	// later loss of that message is seen (checkStream).
	stored uint64
	// pos is the position of the subject's last message (events.PositionHeader): the next
	// message is stored at pos+1. A subject whose messages carry none yet (published by an
	// earlier release) starts counting from the number of messages it holds.
	pos uint64
	// began, base and start are the checkpoint's beginning on the subject (checkpoint.StreamPoint)
	began bool
	base  uint64
	start string
	// alone: the next change is published alone, not in a window (see publishWindow): the last
	// window stopped before its end, and no change was stored alone since.
	alone bool
	// follows: the job's last window on the subject was stored whole (see publishWindow).
	follows bool
	// window is how many changes the next window may hold (0: maxWindow).
	window int
}

// point returns the stream point of message seq with the fence's beginning.
func (f *fence) point(subject string, seq uint64) checkpoint.StreamPoint {
	return checkpoint.StreamPoint{Subject: subject, Seq: seq, Began: f.began, Base: f.base, Start: f.start}
}

// setRead records what a read of the subject found: its last message and its message count.
func (f *fence) setRead(st subjectState) {
	f.last, f.pos, f.read = st.last.seq, st.last.pos, true
	if st.last.pos == 0 {
		f.pos = st.count
	}
}

// perJob holds one kind of a job's values, by key (a subject, a bucket), in the job's context.
type perJob[T any] struct {
	mu sync.Mutex
	m  map[string]*T
}

// of returns the value of key, a new one the first time.
func (p *perJob[T]) of(key string) *T {
	p.mu.Lock()
	defer p.mu.Unlock()
	v := p.m[key]
	if v == nil {
		v = new(T)
		p.m[key] = v
	}
	return v
}

type fencesKey struct{}

// withFences returns ctx carrying a new set of fences for one job: each job reads the subjects it
// publishes to afresh.
func withFences(ctx context.Context) context.Context {
	return context.WithValue(ctx, fencesKey{}, &perJob[fence]{m: map[string]*fence{}})
}

// fenceOf returns the job's fence of subject (a new one, used for one page, when ctx carries
// none).
func fenceOf(ctx context.Context, subject string) *fence {
	fs, _ := ctx.Value(fencesKey{}).(*perJob[fence])
	if fs == nil {
		return &fence{}
	}
	return fs.of(subject)
}

// fenceable reports whether rule's publishes in db are fenced: its subject is its db's own, the
// publisher can read a stream at its leader, and the subject's stream keeps what readers read
// (retention Limits). On a stream whose readers remove messages (WorkQueue or Interest retention)
// a subject's last message says nothing of what was published: such a subject is published in
// feed order, unfenced (check notes those streams).
func (p *changePublisher) fenceable(rule *rules.OnChange, db string) bool {
	if _, ok := p.js.(batchPublisher); !ok || !strings.Contains(rule.Subject, "${db_name}") {
		return false
	}
	name, ok := p.checked.get(subjectFor(rule, db))
	return !ok || !p.consumed.has(name)
}

// jsAPIError is the error of a JetStream API answer.
type jsAPIError struct {
	Code        int    `json:"code"`
	ErrCode     int    `json:"err_code"`
	Description string `json:"description"`
}

// JetStream error codes the publisher tells apart.
const (
	errCodeNoMessage          = 10037 // no message found
	errCodeSeqNotFound        = 10043 // sequence not found
	errCodeBatchHasDuplicates = 10201 // atomic publish batch contains duplicate message id
)

// subjectMsg is what the publisher reads of a message on a subject.
type subjectMsg struct {
	seq     uint64 // its stream sequence (0: no message)
	feedSeq string // the feed seq of the change it carries ("": none, or not a change message)
	pos     uint64 // its position on the subject (events.PositionHeader; 0: none)
	prev    uint64 // the subject's last message when it was published (events.PreviousHeader)
	hasPrev bool
}

// getMsg reads one message of subject's stream at the stream's leader, as req asks
// (last_by_subj, or seq and next_by_subj): found false when there is none. One API request; it
// does not use direct gets, which a replica that lags may answer.
func (p *changePublisher) getMsg(ctx context.Context, subject string, req map[string]any, timeout time.Duration) (subjectMsg, bool, error) {
	var answer struct {
		Message *struct {
			Seq     uint64 `json:"seq"`
			Headers []byte `json:"hdrs"`
			Data    []byte `json:"data"`
		} `json:"message"`
	}
	what := "read a message of subject " + subject
	apiErr, err := p.streamAPI(ctx, subject, "STREAM.MSG.GET", req, timeout, &answer, what)
	switch {
	case err != nil:
		return subjectMsg{}, false, err
	case apiErr != nil && apiErr.ErrCode == errCodeNoMessage:
		return subjectMsg{}, false, nil
	case apiErr != nil:
		return subjectMsg{}, false, apiErr
	case answer.Message == nil:
		return subjectMsg{}, false, fmt.Errorf("%s: empty answer", what)
	}
	m := subjectMsg{seq: answer.Message.Seq}
	var c struct {
		Seq string `json:"seq"`
	}
	_ = json.Unmarshal(answer.Message.Data, &c) // a message of another kind has no feed seq
	m.feedSeq = c.Seq
	if len(answer.Message.Headers) > 0 {
		if hdr, err := nats.DecodeHeadersMsg(answer.Message.Headers); err == nil {
			m.pos, _ = strconv.ParseUint(hdr.Get(events.PositionHeader), 10, 64)
			if v := hdr.Get(events.PreviousHeader); v != "" {
				m.prev, err = strconv.ParseUint(v, 10, 64)
				m.hasPrev = err == nil
			}
		}
	}
	return m, true, nil
}

// lastMessage reads subject's last message at its stream's leader (seq 0 when the subject holds
// none).
func (p *changePublisher) lastMessage(ctx context.Context, subject string, timeout time.Duration) (subjectMsg, error) {
	m, _, err := p.getMsg(ctx, subject, map[string]any{"last_by_subj": subject}, timeout)
	return m, err
}

// nextMessage reads the first message of subject at or after stream sequence seq.
func (p *changePublisher) nextMessage(ctx context.Context, subject string, seq uint64, timeout time.Duration) (subjectMsg, bool, error) {
	return p.getMsg(ctx, subject, map[string]any{"seq": seq, "next_by_subj": subject}, timeout)
}

// subjectCount returns the number of messages subject's stream holds on it, as its leader
// counts them, and the stream's first sequence. One API request.
func (p *changePublisher) subjectCount(ctx context.Context, subject string, timeout time.Duration) (count, first uint64, err error) {
	var answer struct {
		State struct {
			FirstSeq uint64            `json:"first_seq"`
			Subjects map[string]uint64 `json:"subjects"`
		} `json:"state"`
	}
	what := "count the messages of subject " + subject
	apiErr, err := p.streamAPI(ctx, subject, "STREAM.INFO", map[string]string{"subjects_filter": subject}, timeout, &answer, what)
	switch {
	case err != nil:
		return 0, 0, err
	case apiErr != nil:
		return 0, 0, apiErr
	}
	return answer.State.Subjects[subject], answer.State.FirstSeq, nil
}

// subjectState is what a job's first read of a subject finds.
type subjectState struct {
	last        subjectMsg // the subject's last message
	count       uint64     // the subject's messages
	streamFirst uint64     // the stream's first sequence
}

// readSubject reads subject's last message and counts its messages, both at once.
func (p *changePublisher) readSubject(ctx context.Context, subject string, timeout time.Duration) (subjectState, error) {
	var st subjectState
	var countErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		st.count, st.streamFirst, countErr = p.subjectCount(ctx, subject, timeout)
	}()
	last, err := p.lastMessage(ctx, subject, timeout)
	<-done
	st.last = last
	return st, errors.Join(err, countErr)
}

// streamAPI sends req to the JetStream API request api (STREAM.MSG.GET, STREAM.INFO, …) of the
// stream that captures subject, answered by its leader within timeout, and decodes the answer
// into out (nil: only its error). The answer's API error is returned apart from a failure to ask
// (err), so that callers tell the errors they expect; what names the request in errors.
func (p *changePublisher) streamAPI(ctx context.Context, subject, api string, req any, timeout time.Duration, out any, what string) (*streamAPIError, error) {
	name, err := p.streamOf(ctx, subject)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return streamRequest(ctx, p.js.(batchPublisher).Conn(), name, api, req, out, what)
}

// streamRequest sends req to the JetStream API request api of stream name over nc and decodes
// the answer into out (nil: only its error); see streamAPI.
func streamRequest(ctx context.Context, nc *nats.Conn, name, api string, req, out any, what string) (*streamAPIError, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	resp, err := nc.RequestWithContext(ctx, "$JS.API."+api+"."+name, body)
	if err != nil {
		return nil, fmt.Errorf("%s in stream %s: %w", what, name, err)
	}
	var envelope struct {
		Error *jsAPIError `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &envelope); err != nil {
		return nil, fmt.Errorf("%s in stream %s: unreadable answer: %w", what, name, err)
	}
	if envelope.Error != nil {
		return &streamAPIError{what: what, stream: name, jsAPIError: *envelope.Error}, nil
	}
	if out != nil {
		if err := json.Unmarshal(resp.Data, out); err != nil {
			return nil, fmt.Errorf("%s in stream %s: unreadable answer: %w", what, name, err)
		}
	}
	return nil, nil
}

// streamAPIError is the error a stream's JetStream API answered a request with.
type streamAPIError struct {
	what, stream string
	jsAPIError
}

func (e *streamAPIError) Error() string {
	return fmt.Sprintf("%s in stream %s: %s", e.what, e.stream, e.Description)
}

// streamOf returns the name of the stream that captures subject.
func (p *changePublisher) streamOf(ctx context.Context, subject string) (string, error) {
	if name, ok := p.checked.get(subject); ok {
		return name, nil
	}
	name, err := p.js.StreamNameBySubject(ctx, subject)
	if err != nil {
		return "", fmt.Errorf("look up the stream of subject %s: %w", subject, err)
	}
	return name, nil
}

// attemptFenced is attempt under f: the publish expects f.last as the subject's last sequence,
// and a stored (not duplicate) message moves f.last to its own. The caller holds f.mu.
func (p *changePublisher) attemptFenced(m changeMsg, f *fence, timeout time.Duration) webhook.Attempt {
	return func(ctx context.Context) (int, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		publish := func(m changeMsg) (*jetstream.PubAck, error) {
			msg := m.nats()
			msg.Header.Set(events.PositionHeader, strconv.FormatUint(f.pos+1, 10))
			msg.Header.Set(events.PreviousHeader, strconv.FormatUint(f.last, 10))
			ack, err := p.js.PublishMsg(ctx, msg, jetstream.WithExpectLastSequencePerSubject(f.last))
			switch {
			case err != nil && wrongLast(err):
				return nil, fmt.Errorf("publish change %s to %s: %w", m.id, m.subject, errFenced)
			case err != nil:
				return nil, fmt.Errorf("publish change %s to %s: %w", m.id, m.subject, err)
			}
			return ack, nil
		}
		ack, err := publish(m)
		if err != nil {
			return 0, err
		}
		switch {
		case !ack.Duplicate:
			f.last = ack.Sequence
			f.pos++
			f.stored = max(f.stored, ack.Sequence)
			f.alone, f.follows = false, false
		case ack.Sequence > max(f.last, f.stored):
			// Stored after the job read the subject: its own attempt whose answer was lost, most
			// likely. The stream deduplicates by message id across its subjects, so the message
			// is this change's only if it is on this subject (one read, at the leader).
			if got, ok, err := p.nextMessage(ctx, m.subject, ack.Sequence, timeout); err == nil && ok && got.seq == ack.Sequence {
				f.stored = ack.Sequence
			}
		}
		p.published(1)
		return 0, nil
	}
}

// wrongLast reports whether err is the stream refusing an expected last subject sequence that
// it checked (natsjs.IsWrongLastSequence). A check the stream could not make while another write
// on the subject was in flight (natsjs.IsSubjectBusy) is not: the publish is retried.
func wrongLast(err error) bool { return natsjs.IsWrongLastSequence(err) }

// takesAtomicPages reports whether a stream with cfg takes a page as one atomic batch: it allows
// them, and stages them in memory. A single-replica stream on file storage stages every message of
// a batch in a file of its own first, which BenchmarkPublishPage measured slower than publishing
// one at a time; there a page goes one change at a time.
func takesAtomicPages(cfg jetstream.StreamConfig) bool {
	return cfg.AllowAtomicPublish && (cfg.Replicas > 1 || cfg.Storage == jetstream.MemoryStorage)
}

// takesAtomic reports whether subject's stream was found to take atomic pages.
func (p *changePublisher) takesAtomic(subject string) bool {
	_, ok := p.js.(batchPublisher)
	return ok && p.atomic.has(subject)
}

// Headers of an atomic batch.
const (
	batchIDHeader     = "Nats-Batch-Id"
	batchSeqHeader    = "Nats-Batch-Sequence"
	batchCommitHeader = "Nats-Batch-Commit"
)

// publishAtomic publishes msgs, in order, as one JetStream atomic batch (nats-server 2.12+, a
// stream with allow_atomic): the stream stores all of them or none. Under a fence (f not nil)
// the first message expects f.last as the subject's last sequence, and the batch moves f.last to
// its last message. An error wraps errFenced when the stream refused that expectation, and
// errBatchDuplicate when a message of the batch is one the stream has already; after any error
// nothing of the batch is known stored (after a lost answer it may be: the caller's next publishes
// find it as duplicates).
func (p *changePublisher) publishAtomic(ctx context.Context, msgs []changeMsg, f *fence, timeout time.Duration) error {
	if !worker.Held(ctx) {
		return worker.ErrLeaseLost
	}
	batch := make([]*nats.Msg, len(msgs))
	for i, m := range msgs {
		msg := m.nats()
		if f != nil {
			if i == 0 {
				msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(f.last, 10))
			}
			msg.Header.Set(events.PositionHeader, strconv.FormatUint(f.pos+uint64(i)+1, 10))
			msg.Header.Set(events.PreviousHeader, strconv.FormatUint(f.last, 10))
		}
		batch[i] = msg
	}
	seq, err := sendAtomic(ctx, p.js.(batchPublisher).Conn(), batch, timeout)
	if err != nil {
		return fmt.Errorf("publish a batch of %d changes to %s: %w", len(msgs), msgs[0].subject, err)
	}
	if f != nil {
		f.last = seq
		f.stored = max(f.stored, seq)
		f.pos += uint64(len(msgs))
	}
	p.published(len(msgs))
	return nil
}

// sendAtomic sends msgs over nc as one JetStream atomic batch and returns the stream sequence of
// its last message once the stream stored them all, within timeout. An error wraps errFenced when
// the stream refused an expected last sequence of the batch, and errBatchDuplicate when a message
// of the batch is one the stream has already; nothing of the batch is stored then.
func sendAtomic(ctx context.Context, nc *nats.Conn, msgs []*nats.Msg, timeout time.Duration) (uint64, error) {
	inbox := nats.NewInbox()
	answers := make(chan *nats.Msg, 4) // the first message's receipt, then the final answer
	sub, err := nc.ChanSubscribe(inbox, answers)
	if err != nil {
		return 0, fmt.Errorf("subscribe to its answers: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	id := strings.TrimPrefix(nats.NewInbox(), nats.InboxPrefix) // a unique token
	for i, msg := range msgs {
		msg.Header.Set(batchIDHeader, id)
		msg.Header.Set(batchSeqHeader, strconv.Itoa(i+1))
		if i == 0 {
			msg.Reply = inbox // a refusal at the start (too many batches in flight) is answered here
		}
		if i == len(msgs)-1 {
			msg.Header.Set(batchCommitHeader, "1")
			msg.Reply = inbox
		}
		if err := nc.PublishMsg(msg); err != nil {
			return 0, fmt.Errorf("send %s: %w", msg.Subject, err)
		}
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-timer.C:
			return 0, fmt.Errorf("no answer within %s", timeout)
		case m := <-answers:
			if len(m.Data) == 0 {
				continue // the first message staged
			}
			var a struct {
				Seq   uint64      `json:"seq"`
				Batch string      `json:"batch"`
				Count int         `json:"count"`
				Error *jsAPIError `json:"error"`
			}
			if err := json.Unmarshal(m.Data, &a); err != nil {
				return 0, fmt.Errorf("unreadable answer %q", m.Data)
			}
			switch {
			case a.Error != nil && natsjs.WrongLastCode(a.Error.ErrCode):
				return 0, errFenced
			case a.Error != nil && a.Error.ErrCode == errCodeBatchHasDuplicates:
				return 0, errBatchDuplicate
			case a.Error != nil:
				return 0, errors.New(a.Error.Description)
			case a.Batch != id || a.Count != len(msgs):
				return 0, fmt.Errorf("answer of batch %q with %d messages", a.Batch, a.Count)
			}
			return a.Seq, nil
		}
	}
}

// streamPoint returns where the job's last publish to rule's subject in db was stored, or its
// latest write into a mirror rule's bucket, for the checkpoint (nil: neither, or the job has not
// read the subject or written to the bucket yet).
func (h *handler) streamPoint(ctx context.Context, db string, rule *rules.OnChange) *checkpoint.StreamPoint {
	if rule.Mirror != "" {
		return mirrorPointOf(ctx, rule.Mirror).point()
	}
	if rule.Subject == "" || !h.publisher.fenceable(rule, db) {
		return nil
	}
	subject := subjectFor(rule, db)
	f := fenceOf(ctx, subject)
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.read {
		return nil
	}
	pt := f.point(subject, max(f.last, f.stored))
	return &pt
}

// Pipelined windows.
//
// One change at a time, each sent once the stream confirmed the one before it, costs a round trip
// per change. A window costs one for many: its first change is published alone, under the fence
// as any publish, and once the stream stored it (not as a duplicate) at sequence S, the window's
// next changes are sent at once, in feed order, the k-th after the first expecting S+k-1 as the
// stream's last sequence and the message id of the change before it as the stream's last message
// id. So the stream stores each of them only right after the change before it, at the sequence
// the job expects: it stores a prefix of the window, and nothing after a change it did not store.
// A publish refused or lost in the middle (a leader election, a NATS restart, a change too large)
// stops the window there; the change is published again alone, with the rule's retry policy and
// dead letters, before another window follows it. A late message of a holder that lost the job is
// refused as before: the window's first by the fence, a later one because anything stored since
// moved the stream's last sequence.
//
// Both expectations are the stream's, not the subject's: a process sends each window — its
// first change's round trip and the rest — whole, one window per stream at a time (sendLock), so
// that its jobs' windows never cut into one another. A message of another process stored in the
// middle of a window stops the window (a refusal, not a fault), and the windows after it are
// smaller (fence.window) until one is stored whole.

// Bounds of a window (fence.window).
const (
	minWindow = 2
	maxWindow = 1000
)

// asyncPublisher is the part of jetstream.JetStream that windows use; a publisher without it
// publishes one change at a time.
type asyncPublisher interface {
	PublishMsgAsync(msg *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error)
}

// windowSize returns how many changes f's next window on subject may hold (0: no window: the
// next change goes alone). A stream of a JetStream cluster takes no windows: a replica applies a
// message whose expected last message id is not the stream's as a write error that stops the
// stream (nats-server checks it when the message is applied, not before it is proposed), so
// there a page goes as an atomic batch, when the stream allows them, or one change at a time.
func (p *changePublisher) windowSize(f *fence, subject string) int {
	if _, ok := p.js.(asyncPublisher); !ok || f == nil || f.alone {
		return 0
	}
	if name, ok := p.checked.get(subject); !ok || p.clustered.has(name) {
		return 0
	}
	if f.window == 0 {
		return maxWindow
	}
	return f.window
}

// sendLock returns the lock held while a window is sent to stream.
func (p *changePublisher) sendLock(stream string) *sync.Mutex {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	if p.sending == nil {
		p.sending, p.lastSent = map[string]*sync.Mutex{}, map[string]*fence{}
	}
	mu := p.sending[stream]
	if mu == nil {
		mu = &sync.Mutex{}
		p.sending[stream] = mu
	}
	return mu
}

// publishWindow publishes msgs (at least minWindow changes of one subject, in feed order) as one
// window under f (see above; the caller holds f.mu) and returns how many of them the stream
// stored: always a prefix of msgs. f moves past them. Nothing is returned as an error: the caller
// publishes the first change not stored alone, where the rule's retry policy, dead letters and
// the fence's answers apply.
func (p *changePublisher) publishWindow(ctx context.Context, msgs []changeMsg, f *fence, timeout time.Duration) int {
	if len(msgs) < minWindow || !worker.Held(ctx) {
		return 0
	}
	stream, err := p.streamOf(ctx, msgs[0].subject)
	if err != nil {
		return 0
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	w := p.windowSize(f, msgs[0].subject)
	mu := p.sendLock(stream)
	mu.Lock()
	from := 0 // the first change sent without waiting
	if !f.follows || p.lastSent[stream] != f {
		// Another job of the process sent to the stream since this one's last window, or that
		// window stopped early: the stream's last sequence is not known. The first change goes
		// first, under the fence, and tells it.
		first := msgs[0].nats()
		first.Header.Set(events.PositionHeader, strconv.FormatUint(f.pos+1, 10))
		first.Header.Set(events.PreviousHeader, strconv.FormatUint(f.last, 10))
		ack, err := p.js.PublishMsg(ctx, first, jetstream.WithExpectLastSequencePerSubject(f.last))
		if err != nil || ack.Duplicate {
			mu.Unlock()
			f.alone, f.follows = true, false // sent again alone, where its answer counts
			return 0
		}
		f.last, f.pos, f.stored = ack.Sequence, f.pos+1, max(f.stored, ack.Sequence)
		from = 1
	}
	// Each change expects the one before it as the stream's last message: its sequence, the
	// stream's last one when the window's first change was not sent first (this job's last
	// window, stored whole, was the last thing the process sent to the stream), and its id.
	base := f.last // the stream's last sequence before msgs[from]
	futures := make([]jetstream.PubAckFuture, 0, len(msgs)-from)
	for k := from; k < len(msgs); k++ {
		prev := base + uint64(k-from)
		msg := msgs[k].nats()
		msg.Header.Set(events.PositionHeader, strconv.FormatUint(f.pos+uint64(k-from)+1, 10))
		msg.Header.Set(events.PreviousHeader, strconv.FormatUint(prev, 10))
		msg.Header.Set(jetstream.ExpectedLastSeqHeader, strconv.FormatUint(prev, 10))
		if k > 0 {
			msg.Header.Set(jetstream.ExpectedLastMsgIDHeader, msgs[k-1].id)
		}
		// No retry by the client: a publish sent again after the ones behind it is refused anyway.
		fut, err := p.js.(asyncPublisher).PublishMsgAsync(msg, jetstream.WithRetryAttempts(0))
		if err != nil {
			break
		}
		futures = append(futures, fut)
	}
	p.lastSent[stream] = f
	mu.Unlock()

	// The last change the stream stored: each one before it was stored too, right before the next.
	stored := 0
wait:
	for i, fut := range futures {
		select {
		case a := <-fut.Ok():
			if !a.Duplicate && a.Sequence == base+uint64(i)+1 {
				stored = i + 1
			}
		case <-fut.Err():
		case <-ctx.Done():
			break wait
		}
	}
	n := from + stored
	f.last, f.pos = base+uint64(stored), f.pos+uint64(stored)
	f.stored = max(f.stored, f.last)
	f.follows = n == len(msgs)
	switch {
	case n < len(msgs):
		f.alone, f.window = true, max(minWindow, w/2)
	case n == w:
		f.window = min(maxWindow, 2*w)
	}
	p.published(n)
	return n
}
