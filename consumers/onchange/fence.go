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
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
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
}

// jobFences are a job's fences, by subject.
type jobFences struct {
	mu sync.Mutex
	m  map[string]*fence
}

type fencesKey struct{}

// withFences returns ctx carrying a new set of fences for one job: each job reads the subjects it
// publishes to afresh.
func withFences(ctx context.Context) context.Context {
	return context.WithValue(ctx, fencesKey{}, &jobFences{m: map[string]*fence{}})
}

// fenceOf returns the job's fence of subject (a new one, used for one page, when ctx carries
// none).
func fenceOf(ctx context.Context, subject string) *fence {
	fs, _ := ctx.Value(fencesKey{}).(*jobFences)
	if fs == nil {
		return &fence{}
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f := fs.m[subject]
	if f == nil {
		f = &fence{}
		fs.m[subject] = f
	}
	return f
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
	errCodeWrongLastSeq       = 10071 // wrong last sequence
	errCodeWrongLastSeqBusy   = 10164 // wrong last sequence (a replicated stream with a check on the subject in flight)
	errCodeBatchHasDuplicates = 10201 // atomic publish batch contains duplicate message id
)

// lastMessage reads subject's last message at its stream's leader: its sequence (0 when the
// subject holds none) and the feed seq of the change it carries ("" when none, or when it is not a
// change message). One API request; it does not use direct gets, which a replica that lags may
// answer.
func (p *changePublisher) lastMessage(ctx context.Context, subject string, timeout time.Duration) (uint64, string, error) {
	name, err := p.streamOf(ctx, subject)
	if err != nil {
		return 0, "", err
	}
	req, err := json.Marshal(map[string]string{"last_by_subj": subject})
	if err != nil {
		return 0, "", err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := p.js.(batchPublisher).Conn().RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+name, req)
	if err != nil {
		return 0, "", fmt.Errorf("read the last message of subject %s in stream %s: %w", subject, name, err)
	}
	var answer struct {
		Message *struct {
			Seq  uint64 `json:"seq"`
			Data []byte `json:"data"`
		} `json:"message"`
		Error *jsAPIError `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &answer); err != nil {
		return 0, "", fmt.Errorf("read the last message of subject %s in stream %s: unreadable answer: %w", subject, name, err)
	}
	switch {
	case answer.Error != nil && answer.Error.ErrCode == errCodeNoMessage:
		return 0, "", nil
	case answer.Error != nil:
		return 0, "", fmt.Errorf("read the last message of subject %s in stream %s: %s", subject, name, answer.Error.Description)
	case answer.Message == nil:
		return 0, "", fmt.Errorf("read the last message of subject %s in stream %s: empty answer", subject, name)
	}
	var c struct {
		Seq string `json:"seq"`
	}
	_ = json.Unmarshal(answer.Message.Data, &c) // a message of another kind has no feed seq
	return answer.Message.Seq, c.Seq, nil
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

// firstSeq returns the sequence of the first message the stream of subject holds.
func (p *changePublisher) firstSeq(ctx context.Context, subject string, timeout time.Duration) (uint64, error) {
	name, err := p.streamOf(ctx, subject)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st, err := p.js.(batchPublisher).Stream(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("read stream %s: %w", name, err)
	}
	return st.CachedInfo().State.FirstSeq, nil
}

// attemptFenced is attempt under f: the publish expects f.last as the subject's last sequence,
// and a stored (not duplicate) message moves f.last to its own. The caller holds f.mu.
func (p *changePublisher) attemptFenced(m changeMsg, f *fence, timeout time.Duration) webhook.Attempt {
	return func(ctx context.Context) (int, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		ack, err := p.js.PublishMsg(ctx, m.nats(), jetstream.WithExpectLastSequencePerSubject(f.last))
		if err != nil {
			if wrongLast(err) {
				return 0, fmt.Errorf("publish change %s to %s: %w", m.id, m.subject, errFenced)
			}
			return 0, fmt.Errorf("publish change %s to %s: %w", m.id, m.subject, err)
		}
		if !ack.Duplicate {
			f.last = ack.Sequence
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
			}
			p.published(len(msgs))
			return nil
		}
	}
}

// streamPoint returns where the job's last publish to rule's subject in db was stored, for the
// checkpoint (nil: not a fenced subject rule, or the job has not read the subject yet).
func (h *handler) streamPoint(ctx context.Context, db string, rule *rules.OnChange) *checkpoint.StreamPoint {
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
	return &checkpoint.StreamPoint{Subject: subject, Seq: f.last}
}

// healStream checks, before a subject rule publishes anything in a job, that the stream still
// holds what the checkpoint says was stored before it (cp.Stream), and returns the seq the rule
// goes on from. A stream that acknowledged messages and lost them — a NATS node restarted from a
// store older than what it had acknowledged (lazy sync and a power failure), every node so, or a
// truncated file — holds an older last message on the subject: the rule then goes back to the
// feed seq of that message, and the changes after it are published again (the stream lost their
// ids with them, so they are stored). Messages the stream dropped by its own limits (max age) are
// not a loss: its first message is then past cp.Stream. A subject left with no message at all
// sends the rule back to the start of the feed, except for a rule with since "now", whose start is
// not known: that is logged. The read is the job's fence read (see fence.go), so it costs no
// request unless a loss shows.
func (h *handler) healStream(ctx context.Context, db string, rule *rules.OnChange, cp checkpoint.OnChangePoint, since string, log logrus.FieldLogger) (string, error) {
	subject := subjectFor(rule, db)
	if !h.publisher.fenceable(rule) || cp.Stream.Seq == 0 || cp.Stream.Subject != subject {
		return since, nil
	}
	f := fenceOf(ctx, subject)
	f.mu.Lock()
	defer f.mu.Unlock()
	last, from, err := h.publisher.lastMessage(ctx, subject, rule.Timeout)
	if err != nil {
		return since, err
	}
	f.last, f.read = last, true
	if last >= cp.Stream.Seq {
		return since, nil
	}
	first, err := h.publisher.firstSeq(ctx, subject, rule.Timeout)
	if err != nil {
		return since, err
	}
	if first > cp.Stream.Seq {
		return since, nil // dropped by the stream's limits
	}
	log = log.WithFields(logrus.Fields{"subject": subject, "stream_seq": cp.Stream.Seq, "subject_last_seq": last})
	if from == "" && last > 0 || from == "" && rule.Since == rules.SinceNow {
		log.Error("the change stream lost changes it had stored, and where they start is not known: they are not published again")
		return since, nil
	}
	log.WithField("from_seq", from).Warn("the change stream lost changes it had stored: publishing them again")
	return from, nil
}
