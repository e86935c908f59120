package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/events"
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
// before; the README says so.

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
	// later loss of that message is seen (healStream) and the change published again.
	stored uint64
	// pos is the position of the subject's last message (events.PositionHeader): the next
	// message is stored at pos+1. A subject whose messages carry none yet (published by an
	// earlier release) starts counting from the number of messages it holds.
	pos   uint64
	heals []checkpoint.StreamHeal // the subject's recent heals, from the checkpoint (see removed)
	// began, base and start are the checkpoint's beginning on the subject (checkpoint.StreamPoint)
	began bool
	base  uint64
	start string
}

// point returns the stream point of message seq with the fence's heals and beginning.
func (f *fence) point(subject string, seq uint64, heals []checkpoint.StreamHeal) checkpoint.StreamPoint {
	return checkpoint.StreamPoint{Subject: subject, Seq: seq, Heals: heals, Began: f.began, Base: f.base, Start: f.start}
}

// setRead records what a read of the subject found: its last message and its message count.
func (f *fence) setRead(st subjectState) {
	f.last, f.pos, f.read = st.last.seq, st.last.pos, true
	if st.last.pos == 0 {
		f.pos = st.count
	}
}

// removed reports whether seq is the sequence of a message that a heal of the subject removed
// (see healHole), and returns the heal under whose id the change goes again: the latest.
func (f *fence) removed(seq uint64) (checkpoint.StreamHeal, bool) {
	for _, h := range f.heals {
		if seq > h.After && seq <= h.Through {
			return f.heals[len(f.heals)-1], true
		}
	}
	return checkpoint.StreamHeal{}, false
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

// fenceable reports whether rule's publishes are fenced: its subject is its db's own, and the
// publisher can read a stream at its leader.
func (p *changePublisher) fenceable(rule *rules.OnChange) bool {
	_, ok := p.js.(batchPublisher)
	return ok && strings.Contains(rule.Subject, "${db_name}")
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
	errCodeDeleteFailed       = 10057 // message delete failed (its description says why)
	errCodeWrongLastSeq       = 10071 // wrong last sequence
	errCodeWrongLastSeqBusy   = 10164 // wrong last sequence (a replicated stream with a check on the subject in flight)
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

// deleteMessage removes the message at seq from subject's stream (one already gone is no error).
func (p *changePublisher) deleteMessage(ctx context.Context, subject string, seq uint64, timeout time.Duration) error {
	what := fmt.Sprintf("remove message %d of subject %s", seq, subject)
	apiErr, err := p.streamAPI(ctx, subject, "STREAM.MSG.DELETE", map[string]any{"seq": seq, "no_erase": true}, timeout, nil, what)
	if err != nil {
		return err
	}
	gone := apiErr != nil && (apiErr.ErrCode == errCodeNoMessage || apiErr.ErrCode == errCodeSeqNotFound ||
		apiErr.ErrCode == errCodeDeleteFailed && strings.Contains(apiErr.Description, "no message found"))
	if apiErr != nil && !gone {
		return apiErr
	}
	return nil
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
		if heal, ok := f.removed(ack.Sequence); ok && ack.Duplicate {
			// The stream remembers the id of a message a heal removed: not stored, so the change
			// goes again under the heal's id.
			m.id = events.HealMsgID(heal.ID, m.id)
			if ack, err = publish(m); err != nil {
				return 0, err
			}
		}
		switch {
		case !ack.Duplicate:
			f.last = ack.Sequence
			f.pos++
			f.stored = max(f.stored, ack.Sequence)
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

// wrongLast reports whether err is the stream refusing an expected last subject sequence.
func wrongLast(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == errCodeWrongLastSeq || apiErr.ErrorCode == errCodeWrongLastSeqBusy)
}

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
	nc := p.js.(batchPublisher).Conn()
	inbox := nats.NewInbox()
	answers := make(chan *nats.Msg, 4) // the first message's receipt, then the final answer
	sub, err := nc.ChanSubscribe(inbox, answers)
	if err != nil {
		return fmt.Errorf("publish a batch of %d changes: subscribe to its answers: %w", len(msgs), err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	id := strings.TrimPrefix(nats.NewInbox(), nats.InboxPrefix) // a unique token
	for i, m := range msgs {
		msg := m.nats()
		msg.Header.Set(batchIDHeader, id)
		msg.Header.Set(batchSeqHeader, strconv.Itoa(i+1))
		if i == 0 {
			msg.Reply = inbox // a refusal at the start (too many batches in flight) is answered here
			if f != nil {
				msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(f.last, 10))
			}
		}
		if f != nil {
			msg.Header.Set(events.PositionHeader, strconv.FormatUint(f.pos+uint64(i)+1, 10))
			msg.Header.Set(events.PreviousHeader, strconv.FormatUint(f.last, 10))
		}
		if i == len(msgs)-1 {
			msg.Header.Set(batchCommitHeader, "1")
			msg.Reply = inbox
		}
		if err := nc.PublishMsg(msg); err != nil {
			return fmt.Errorf("publish change %s to %s in a batch: %w", m.id, m.subject, err)
		}
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-timer.C:
			return fmt.Errorf("publish a batch of %d changes to %s: no answer within %s", len(msgs), msgs[0].subject, timeout)
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
				return fmt.Errorf("publish a batch of %d changes to %s: unreadable answer %q", len(msgs), msgs[0].subject, m.Data)
			}
			switch {
			case a.Error != nil && (a.Error.ErrCode == errCodeWrongLastSeq || a.Error.ErrCode == errCodeWrongLastSeqBusy):
				return fmt.Errorf("publish a batch of %d changes to %s: %w", len(msgs), msgs[0].subject, errFenced)
			case a.Error != nil && a.Error.ErrCode == errCodeBatchHasDuplicates:
				return fmt.Errorf("publish a batch of %d changes to %s: %w", len(msgs), msgs[0].subject, errBatchDuplicate)
			case a.Error != nil:
				return fmt.Errorf("publish a batch of %d changes to %s: %s", len(msgs), msgs[0].subject, a.Error.Description)
			case a.Batch != id || a.Count != len(msgs):
				return fmt.Errorf("publish a batch of %d changes to %s: answer of batch %q with %d changes", len(msgs), msgs[0].subject, a.Batch, a.Count)
			}
			if f != nil {
				f.last = a.Seq
				f.stored = max(f.stored, a.Seq)
				f.pos += uint64(len(msgs))
			}
			p.published(len(msgs))
			return nil
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
	if rule.Subject == "" || !h.publisher.fenceable(rule) {
		return nil
	}
	subject := subjectFor(rule, db)
	f := fenceOf(ctx, subject)
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.read {
		return nil
	}
	pt := f.point(subject, max(f.last, f.stored), f.heals)
	return &pt
}

// healStream checks, before a subject rule publishes anything in a job, that the stream still
// holds what was stored on the rule's subject, and returns the seq the rule goes on from. It is
// the job's fence read (see fence.go): the subject's last message and its message count, read at
// once.
//
// A stream that acknowledged messages and lost them — a NATS node restarted from a store older
// than what it had acknowledged (lazy sync and a power failure), every node so, a truncated file,
// a store copied file by file — may have lost them in two ways:
//   - at the end: the subject's last message is older than the one the checkpoint records
//     (cp.Stream). The rule goes back to the feed seq of that message, and the changes after it
//     are published again (the stream lost their ids with them, so they are stored);
//   - in the middle (a hole): the subject holds fewer messages than the positions of its messages
//     say (events.PositionHeader). See healHole.
//
// Messages the stream dropped by its own limits (max age) are not a loss: they are the oldest, so
// the positions of the messages left still follow each other, and the stream's first message is
// past cp.Stream. A subject left with no message at all sends the rule back to the start of the
// feed, except for a rule with since "now", whose start is not known: that is logged.
func (h *handler) healStream(ctx context.Context, db string, rule *rules.OnChange, cps *checkpointWriter, since string, log logrus.FieldLogger) (string, error) {
	subject := subjectFor(rule, db)
	if !h.publisher.fenceable(rule) {
		return since, nil
	}
	f := fenceOf(ctx, subject)
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := h.publisher.readSubject(ctx, subject, rule.Timeout)
	if err != nil {
		return since, err
	}
	f.setRead(st)
	last := st.last
	cp := cps.cp
	if cp.Stream.Subject == subject {
		f.heals = cp.Stream.Heals
	}
	switch {
	case cp.Stream.Subject == subject && cp.Stream.Began:
		f.began, f.base, f.start = true, cp.Stream.Base, cp.Stream.Start
	case cps.fresh && cp.Stream.Seq == 0:
		// The rule's first run in this db (or in a db created again under its name): what the
		// subject holds now is not this db's.
		f.began, f.base, f.start = true, last.seq, since
	}
	log = log.WithField("subject", subject)
	if hole, err := h.publisher.findHole(ctx, subject, st, rule.Timeout, log); err != nil {
		return since, err
	} else if hole != nil {
		h.lossNoticed(ctx, subject)
		return h.healHole(ctx, db, rule, cps, f, subject, *hole, since, log)
	}
	if cp.Stream.Seq == 0 || cp.Stream.Subject != subject || last.seq >= cp.Stream.Seq {
		return since, nil
	}
	if st.streamFirst > cp.Stream.Seq {
		return since, nil // dropped by the stream's limits
	}
	log = log.WithFields(logrus.Fields{"stream_seq": cp.Stream.Seq, "subject_last_seq": last.seq})
	h.lossNoticed(ctx, subject)
	if cp.Stream.Began && last.seq <= cp.Stream.Base {
		// Every change of this db the stream held is lost, and its last message (if any) is one
		// of an earlier db of the same name: its feed seq would skip changes of this one.
		log.WithField("from_seq", cp.Stream.Start).Warn("the change stream lost every change of the db it had stored: publishing them again from the rule's start in the db")
		return cp.Stream.Start, nil
	}
	if last.feedSeq == "" && last.seq > 0 || last.feedSeq == "" && rule.Since == rules.SinceNow {
		log.Error("the change stream lost changes it had stored, and where they start is not known: they are not published again")
		return since, nil
	}
	log.WithField("from_seq", last.feedSeq).Warn("the change stream lost changes it had stored: publishing them again")
	return last.feedSeq, nil
}

// lossNoticed tells the producers that the stream capturing subject lost messages it had
// acknowledged (events.Subjects.StreamLoss): they rebuild its replicas from its leader, so that
// the heals of the jobs hold whichever replica leads next, and enqueue the dbs of its rules. Fire
// and forget: the next job that finds the loss tells them again.
func (h *handler) lossNoticed(ctx context.Context, subject string) {
	if h.notice == nil {
		return
	}
	if stream, err := h.publisher.streamOf(ctx, subject); err == nil {
		h.tellLoss(stream)
	}
}

// tellLoss tells the producers that stream lost messages it had acknowledged (see lossNoticed).
func (h *handler) tellLoss(stream string) {
	if h.notice != nil {
		h.notice(stream)
	}
}

// hole is a gap in a subject: before is the last message stored before it (seq 0: the gap is
// at the subject's start), after the sequences of the messages stored after it, up to the
// subject's last.
type hole struct {
	before subjectMsg
	after  []uint64
}

// findHole looks for a hole in subject, whose state the caller read: nil when the positions of
// the subject's messages follow each other from a start the stream's limits explain. It costs
// no request unless the count falls short of the last message's position: then one read of the
// subject's first message, which tells the oldest messages dropped by the stream's limits (its
// previous message is before the stream's first) from lost ones, and, for a hole, one read per
// message on the subject to find it. A subject whose messages carry no position (an earlier
// release published them) cannot be checked.
func (p *changePublisher) findHole(ctx context.Context, subject string, st subjectState, timeout time.Duration, log logrus.FieldLogger) (*hole, error) {
	last, count := st.last, st.count
	if last.pos == 0 || count >= last.pos {
		return nil, nil
	}
	first, ok, err := p.nextMessage(ctx, subject, 1, timeout)
	if err != nil || !ok {
		return nil, err
	}
	if first.pos == 0 {
		log.Debug("the subject's oldest messages carry no position: its messages are not checked for a hole")
		return nil, nil
	}
	// The messages before the first were stored at or after its previous one; the stream's
	// limits drop the oldest first, so they cannot have dropped one at or after the stream's
	// first sequence.
	frontLost := first.pos > 1 && first.hasPrev && max(first.prev, 1) >= st.streamFirst
	if !frontLost && first.pos <= last.pos && last.pos-first.pos+1 == count {
		return nil, nil // the oldest dropped by the stream's limits
	}
	collect := func(h *hole, m subjectMsg) (*hole, error) {
		for ok := true; ok && m.seq <= last.seq; m, ok, err = p.nextMessage(ctx, subject, m.seq+1, timeout) {
			if err != nil {
				return nil, err
			}
			h.after = append(h.after, m.seq)
		}
		return h, err
	}
	if frontLost {
		return collect(&hole{}, first)
	}
	for prev := first; prev.seq < last.seq; {
		m, ok, err := p.nextMessage(ctx, subject, prev.seq+1, timeout)
		switch {
		case err != nil:
			return nil, err
		case !ok || m.pos == 0:
			return nil, nil // the subject changed under the walk, or a message without a position
		case m.pos == prev.pos+1:
			prev = m
			continue
		}
		return collect(&hole{before: prev}, m)
	}
	return nil, nil
}

// healMemory is how long a heal is remembered (see fence.removed): the changes stream's duplicate
// window and a margin. At most maxHeals are kept, the latest.
const (
	healMemory = 25 * time.Hour
	maxHeals   = 8
)

// healHole heals a hole in subject, so that the subject holds every change once, in feed order,
// again (a hole at the subject's start — its oldest messages lost — is healed from the start of
// the db's feed, every message of the subject being after it):
//  1. the checkpoint goes back to the message before the hole, its _local doc written at once,
//     with a new heal recorded: the messages after it up to the subject's last are about to be
//     removed. Fenced like every checkpoint write: a stale holder cannot move it.
//  2. those messages are removed, the latest first;
//  3. the job goes on from the feed seq of the message before the hole, and publishes the changes
//     of the hole and after it again. The stream remembers the ids of the removed messages for
//     its duplicate window; a change answered as a duplicate of one of them goes again under the
//     heal's id (events.HealMsgID, see attemptFenced). The heal is kept in the checkpoint for that
//     window, so a later job that reads the changes again knows it too.
//
// A job that stops anywhere in between leaves the hole, or the subject cut back to before it,
// for the next job to find. Services that followed the subject live saw the changes after the
// hole before those of the hole; the README says what they see.
func (h *handler) healHole(ctx context.Context, db string, rule *rules.OnChange, cps *checkpointWriter, f *fence, subject string, gap hole, since string, log logrus.FieldLogger) (string, error) {
	log = log.WithFields(logrus.Fields{"before_hole_seq": gap.before.seq, "messages_after": len(gap.after)})
	switch {
	case len(gap.after) == 0:
		return since, nil
	case gap.before.seq == 0 && rule.Since == rules.SinceNow:
		log.Error("the change stream lost the oldest changes of the subject, and where the rule started (since now) is not known: not healed")
		return since, nil
	case gap.before.seq != 0 && gap.before.feedSeq == "":
		log.Error("the change stream lost changes in the middle of the subject, and the message before them carries no feed seq: not healed")
		return since, nil
	}
	if !worker.Held(ctx) {
		return since, worker.ErrLeaseLost
	}
	id, err := newHealID()
	if err != nil {
		return since, err
	}
	heals := []checkpoint.StreamHeal{}
	for _, old := range f.heals {
		if time.Since(old.At) < healMemory {
			heals = append(heals, old)
		}
	}
	heals = append(heals, checkpoint.StreamHeal{ID: id, After: gap.before.seq, Through: gap.after[len(gap.after)-1], At: time.Now().UTC()})
	if len(heals) > maxHeals {
		heals = heals[len(heals)-maxHeals:]
	}
	if err := cps.wait(); err != nil {
		return since, err
	}
	cps.cp.Stream = f.point(subject, gap.before.seq, heals)
	if err := h.store.SaveNow(ctx, &cps.cp, gap.before.feedSeq); err != nil {
		return since, err
	}
	cps.stored = gap.before.feedSeq
	for i := len(gap.after) - 1; i >= 0; i-- {
		if !worker.Held(ctx) {
			return since, worker.ErrLeaseLost
		}
		if err := h.publisher.deleteMessage(ctx, subject, gap.after[i], rule.Timeout); err != nil {
			return since, err
		}
	}
	f.last, f.stored, f.pos, f.heals = gap.before.seq, 0, gap.before.pos, heals
	h.metrics.StreamHealed()
	where := "in the middle of the subject"
	if gap.before.seq == 0 {
		where = "at the start of the subject"
	}
	log.WithFields(logrus.Fields{"from_seq": gap.before.feedSeq, "heal": id}).
		Warn("the change stream lost changes " + where + ": removed the messages after the hole and publishing the changes from it again, in order")
	return gap.before.feedSeq, nil
}

// newHealID returns a new heal's id: 16 random hex digits.
func newHealID() (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("heal the change stream: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}
