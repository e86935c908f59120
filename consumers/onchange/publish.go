package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/webhook"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// subjectCheckTTL is how long the answer "a stream captures this subject" is reused.
const subjectCheckTTL = 30 * time.Second

// streamPublisher is the part of jetstream.JetStream that subject rules use.
type streamPublisher interface {
	PublishMsg(ctx context.Context, msg *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error)
	PublishMsgAsync(msg *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error)
	StreamNameBySubject(ctx context.Context, subject string) (string, error)
}

// changePublisher publishes changes for `subject` rules (SPEC §3): the change JSON with message
// id <db>/<doc id>/<rev>, so that replays are deduplicated by the stream. Safe for concurrent use.
type changePublisher struct {
	js      streamPublisher
	metrics *metrics.Consumer

	mu       sync.Mutex
	checked  map[string]time.Time // subjects found captured by a stream, and when
	reported map[string]bool      // rule id, rev and subject already dead-lettered as unusable
}

func newChangePublisher(js streamPublisher, m *metrics.Consumer) *changePublisher {
	return &changePublisher{js: js, metrics: m, checked: map[string]time.Time{}, reported: map[string]bool{}}
}

// subject returns rule's subject for db: ${db_name} becomes the db's subject token
// (events.EncodeDBName), so any db name gives one valid token.
func subjectFor(rule *rules.OnChange, db string) string {
	return rules.Interpolate(rule.Subject, rules.Vars{DBName: events.EncodeDBName(db)}, false)
}

// check reports whether some stream captures rule's subject for db. When none does, the rule
// cannot run in db: the first time per rule revision and subject a dead-letter record naming the
// rule is stored and an error logged; the rule's checkpoint stays where it is, so its changes
// flow once a stream captures the subject or the rule is fixed. Other rules are not affected.
// err is a failure to ask NATS or to store the record (transient).
func (p *changePublisher) check(ctx context.Context, db string, rule *rules.OnChange, dead deadLetterer, log logrus.FieldLogger) (bool, error) {
	subject := subjectFor(rule, db)
	p.mu.Lock()
	at, ok := p.checked[subject]
	p.mu.Unlock()
	if ok && time.Since(at) < subjectCheckTTL {
		return true, nil
	}
	_, err := p.js.StreamNameBySubject(ctx, subject)
	if err == nil {
		p.mu.Lock()
		p.checked[subject] = time.Now()
		p.mu.Unlock()
		return true, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, fmt.Errorf("rule %s: look up the stream of subject %s: %w", rule.ID(), subject, err)
	}
	key := rule.ID() + "\x00" + rule.Rev() + "\x00" + subject
	p.mu.Lock()
	done := p.reported[key]
	p.mu.Unlock()
	if done {
		return false, nil
	}
	msg := fmt.Sprintf("rule %s is unusable: no stream captures subject %s", rule.ID(), subject)
	rec := worker.DeadLetter{Group: events.GroupOnChange, DB: db, Rule: rule.ID(), Error: msg,
		Details: map[string]any{"subject": subject, "rule_rev": rule.Rev()}}
	if err := dead.Publish(ctx, rec); err != nil {
		return false, err
	}
	p.metrics.DeadLetter(events.GroupOnChange)
	p.mu.Lock()
	p.reported[key] = true
	p.mu.Unlock()
	log.WithField("subject", subject).Error(msg + "; its changes wait until a stream captures the subject (dead letter recorded)")
	return false, nil
}

// changeMessage is the JSON published for one change.
type changeMessage struct {
	DB      string          `json:"db"`
	Seq     string          `json:"seq"`
	ID      string          `json:"id"`
	Changes []revEntry      `json:"changes"`
	Deleted bool            `json:"deleted,omitempty"`
	Doc     json.RawMessage `json:"doc,omitempty"`
}

type revEntry struct {
	Rev string `json:"rev"`
}

// changeMsg is the message of one change for a subject rule: subject, message id (for the
// stream's deduplication) and the change JSON.
type changeMsg struct {
	subject, id string
	data        []byte
}

// nats returns a new message for one publish, its id in the Nats-Msg-Id header.
func (m changeMsg) nats() *nats.Msg {
	msg := &nats.Msg{Subject: m.subject, Data: m.data, Header: nats.Header{}}
	msg.Header.Set(jetstream.MsgIDHeader, m.id)
	return msg
}

// message builds the message of change c of db for rule.
func (p *changePublisher) message(db string, rule *rules.OnChange, c change) (changeMsg, error) {
	msg := changeMessage{DB: db, Seq: c.Seq, ID: c.ID, Deleted: c.Deleted, Doc: c.Doc}
	for _, r := range c.Revs {
		msg.Changes = append(msg.Changes, revEntry{Rev: r})
	}
	data, err := json.Marshal(msg)
	if err != nil {
		return changeMsg{}, fmt.Errorf("%w: encode change %s: %v", webhook.ErrBadRequest, c.ID, err)
	}
	return changeMsg{subject: subjectFor(rule, db), id: events.ChangeMsgID(db, c.ID, c.rev()), data: data}, nil
}

// attempt returns the synchronous publish of m as a retryable action (the one that runs after
// a pipelined publish failed).
func (p *changePublisher) attempt(m changeMsg, timeout time.Duration) webhook.Attempt {
	return func(ctx context.Context) (int, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		if _, err := p.js.PublishMsg(ctx, m.nats()); err != nil {
			return 0, fmt.Errorf("publish change %s to %s: %w", m.id, m.subject, err)
		}
		p.published(1)
		return 0, nil
	}
}

func (p *changePublisher) published(n int) {
	if p.metrics != nil {
		p.metrics.ChangesPublished.Add(float64(n))
	}
}

// pipelined is one publish of a pipeline: the action's index in its batch and its answer.
type pipelined struct {
	index  int
	future jetstream.PubAckFuture
	err    error // the publish could not even be sent
}

// publishPipelined publishes the changes of acts (nil entries are changes the rule skips) from
// index from on, all at once and in feed order, on one connection, so that the stream stores
// them in feed order; then it waits for every answer, in order, each for at most timeout. It
// returns the index of the first publish that failed (len(acts) when all succeeded) and its
// error. Publishes after a failed one may be stored already: publishing them again is
// deduplicated by their message ids.
func (p *changePublisher) publishPipelined(ctx context.Context, acts []*action, from int, timeout time.Duration) (int, error) {
	sent := make([]pipelined, 0, len(acts)-from)
	for i := from; i < len(acts); i++ {
		if acts[i] == nil {
			continue
		}
		if acts[i].msg == nil { // the change could not be encoded: the action reports why
			sent = append(sent, pipelined{index: i, err: errUnpublishable})
			break
		}
		if !worker.Held(ctx) { // paused past AckWait: another instance may publish these now
			sent = append(sent, pipelined{index: i, err: worker.ErrLeaseLost})
			break
		}
		m := *acts[i].msg
		f, err := p.js.PublishMsgAsync(m.nats())
		sent = append(sent, pipelined{index: i, future: f, err: err})
		if err != nil {
			break // e.g. too many publishes awaiting an answer: settle what was sent
		}
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	ok := 0
	defer func() { p.published(ok) }()
	for _, s := range sent {
		if s.err != nil {
			return s.index, s.err
		}
		select {
		case <-s.future.Ok():
			ok++
		case err := <-s.future.Err():
			return s.index, err
		case <-timer.C:
			return s.index, fmt.Errorf("publish change to %s: no answer within %s", s.future.Msg().Subject, timeout)
		case <-ctx.Done():
			return s.index, ctx.Err()
		}
	}
	return len(acts), nil
}

// errUnpublishable marks a change whose message could not be built.
var errUnpublishable = errors.New("change cannot be published")
