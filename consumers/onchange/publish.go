package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
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

const (
	// subjectCheckTTL is how long the answer "a stream captures this subject" is reused.
	subjectCheckTTL = 30 * time.Second
	// reportedTTL is how long an unusable subject is not dead-lettered again: about once a day
	// per rule revision and subject while nobody fixes it.
	reportedTTL = 24 * time.Hour
	// publisherMemory caps the entries of each of the publisher's sets (about 100 bytes each):
	// past it the expired entries go, then arbitrary ones, which only costs a lookup or a dead
	// letter again.
	publisherMemory = 1 << 16
)

// streamPublisher is the part of jetstream.JetStream that subject rules use.
type streamPublisher interface {
	PublishMsg(ctx context.Context, msg *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error)
	StreamNameBySubject(ctx context.Context, subject string) (string, error)
}

// batchPublisher is the part of jetstream.JetStream that fast batch publishes use besides
// streamPublisher's: a publisher without it publishes one change at a time.
type batchPublisher interface {
	Stream(ctx context.Context, name string) (jetstream.Stream, error)
	Conn() *nats.Conn
}

// changePublisher publishes changes for `subject` rules (SPEC §3): the change JSON with message
// id <db>/<doc id>/<rev>, so that a re-dispatch is deduplicated by the stream (a replay's
// messages have their own ids, see events.ReplayMsgID). Safe for concurrent use. Its memory is
// bounded whatever the number of dbs.
type changePublisher struct {
	js      streamPublisher
	metrics *metrics.Consumer

	checked *expiringSet // subjects found captured by a stream
	batched *expiringSet // those of them whose stream allows fast batch publishes

	streamsRead, batchedStreams *expiringSet // stream names whose info was read; those allowing fast batches
	reported                    *expiringSet // rule id, rev and subject already dead-lettered as unusable
}

func newChangePublisher(js streamPublisher, m *metrics.Consumer) *changePublisher {
	return &changePublisher{js: js, metrics: m,
		checked: newExpiringSet(subjectCheckTTL, publisherMemory), batched: newExpiringSet(subjectCheckTTL, publisherMemory),
		reported:    newExpiringSet(reportedTTL, publisherMemory),
		streamsRead: newExpiringSet(subjectCheckTTL, publisherMemory), batchedStreams: newExpiringSet(subjectCheckTTL, publisherMemory)}
}

// subject returns rule's subject for db: ${db_name} becomes the db's subject token
// (events.EncodeDBName), so any db name gives one valid token.
func subjectFor(rule *rules.OnChange, db string) string {
	return rules.Interpolate(rule.Subject, rules.Vars{DBName: events.EncodeDBName(db)}, false)
}

// check reports whether some stream captures rule's subject for db, and notes whether that
// stream allows fast batch publishes (see publishFast). When none does, the rule cannot run in
// db: the first time per rule revision and subject (again after reportedTTL) a dead-letter record
// naming the rule is stored and an error logged; the rule's checkpoint stays where it is, so its
// changes flow once a stream captures the subject or the rule is fixed. Other rules are not affected.
// err is a failure to ask NATS or to store the record (transient).
func (p *changePublisher) check(ctx context.Context, db string, rule *rules.OnChange, dead deadLetterer, log logrus.FieldLogger) (bool, error) {
	subject := subjectFor(rule, db)
	if p.checked.has(subject) {
		return true, nil
	}
	name, err := p.js.StreamNameBySubject(ctx, subject)
	if err == nil {
		if bp, ok := p.js.(batchPublisher); ok {
			if !p.streamsRead.has(name) { // one stream info read per stream, not per subject
				st, err := bp.Stream(ctx, name)
				if err != nil {
					return false, fmt.Errorf("rule %s: read stream %s of subject %s: %w", rule.ID(), name, subject, err)
				}
				if st.CachedInfo().Config.AllowBatchPublish {
					p.batchedStreams.add(name)
				}
				p.streamsRead.add(name)
			}
			if p.batchedStreams.has(name) {
				p.batched.add(subject)
			}
		}
		p.checked.add(subject)
		return true, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, fmt.Errorf("rule %s: look up the stream of subject %s: %w", rule.ID(), subject, err)
	}
	key := rule.ID() + "\x00" + rule.Rev() + "\x00" + subject
	if p.reported.has(key) {
		return false, nil
	}
	msg := fmt.Sprintf("rule %s is unusable: no stream captures subject %s", rule.ID(), subject)
	rec := worker.DeadLetter{Group: events.GroupOnChange, DB: db, Rule: rule.ID(), Error: msg,
		Details: map[string]any{"subject": subject, "rule_rev": rule.Rev()}}
	if err := dead.Publish(ctx, rec); err != nil {
		return false, err
	}
	p.metrics.DeadLetter(events.GroupOnChange)
	p.reported.add(key)
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
// stream's deduplication), the replay that publishes it ("" for a first publication) and the
// change JSON.
type changeMsg struct {
	subject, id, replay string
	data                []byte
}

// nats returns a new message for one publish, its id in the Nats-Msg-Id header and its replay,
// if any, in the Spiegel-Replay header.
func (m changeMsg) nats() *nats.Msg {
	msg := &nats.Msg{Subject: m.subject, Data: m.data, Header: nats.Header{}}
	msg.Header.Set(jetstream.MsgIDHeader, m.id)
	if m.replay != "" {
		msg.Header.Set(events.ReplayHeader, m.replay)
	}
	return msg
}

// message builds the message of change c of db for rule; replay names the replay that
// publishes it again ("" for none).
func (p *changePublisher) message(db string, rule *rules.OnChange, c change, replay string) (changeMsg, error) {
	msg := changeMessage{DB: db, Seq: c.Seq, ID: c.ID, Deleted: c.Deleted, Doc: c.Doc}
	for _, r := range c.Revs {
		msg.Changes = append(msg.Changes, revEntry{Rev: r})
	}
	data, err := json.Marshal(msg)
	if err != nil {
		return changeMsg{}, fmt.Errorf("%w: encode change %s: %v", webhook.ErrBadRequest, c.ID, err)
	}
	id := events.ChangeMsgID(db, c.ID, c.rev())
	if replay != "" {
		id = events.ReplayMsgID(replay, db, c.ID, c.rev())
	}
	return changeMsg{subject: subjectFor(rule, db), id: id, replay: replay, data: data}, nil
}

// attempt returns the publish of m as a retryable action: it returns once the stream stored m
// (or had stored it already: a duplicate id) or the publish failed, within timeout.
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

// expiringSet is a set of strings whose entries expire after ttl, holding at most max entries
// (see add). Safe for concurrent use.
type expiringSet struct {
	mu  sync.Mutex
	ttl time.Duration
	max int
	at  map[string]time.Time
	now func() time.Time
}

func newExpiringSet(ttl time.Duration, max int) *expiringSet {
	return &expiringSet{ttl: ttl, max: max, at: map[string]time.Time{}, now: time.Now}
}

// has reports whether key was added less than ttl ago.
func (s *expiringSet) has(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	at, ok := s.at[key]
	return ok && s.now().Sub(at) < s.ttl
}

// add records key as of now. A full set first drops its expired entries, then, if that was not
// enough, arbitrary ones down to three quarters of max.
func (s *expiringSet) add(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if _, ok := s.at[key]; !ok && len(s.at) >= s.max {
		for k, at := range s.at {
			if now.Sub(at) >= s.ttl {
				delete(s.at, k)
			}
		}
		for k := range s.at {
			if len(s.at) <= s.max*3/4 {
				break
			}
			delete(s.at, k)
		}
	}
	s.at[key] = now
}

// len returns the number of entries held (expired ones included until swept).
func (s *expiringSet) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.at)
}

// fastBatchFlow is the most messages a fast batch lets the server go between two flow
// acknowledgements (the server's own cap is 500). The publisher does not wait for them: a page is
// at most SPIEGEL_CHANGES_BATCH changes.
const fastBatchFlow = 500

// canBatch reports whether subject's stream was found to allow fast batch publishes.
func (p *changePublisher) canBatch(subject string) bool {
	_, ok := p.js.(batchPublisher)
	return ok && p.batched.has(subject)
}

// batchAnswer is any answer of the stream to a fast batch publish: a flow acknowledgement, gap
// or error (Type set) or the batch's final PubAck (Type empty).
type batchAnswer struct {
	Type  string `json:"type"`
	Seq   uint64 `json:"seq"`
	Count int    `json:"count"`
	Batch string `json:"batch"`
	Error *struct {
		Code        int    `json:"code"`
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error"`
}

// publishFast publishes msgs, in order, as one JetStream fast batch in "gap: fail" mode
// (nats-server 2.14+): every message is sent at once, and the stream stores them in order up to
// the first that it did not get or refused, and none after it — a lost or refused message ends
// the batch there. The final answer says how many were stored (a message whose id the stream
// holds already counts as stored). It returns that count, and an error when it is not all of
// msgs or no final answer came within timeout (then 0: the caller cannot know more than that
// nothing after a missing message was stored). The caller publishes the rest one at a time.
func (p *changePublisher) publishFast(ctx context.Context, msgs []changeMsg, timeout time.Duration) (int, error) {
	if !worker.Held(ctx) {
		return 0, worker.ErrLeaseLost
	}
	nc := p.js.(batchPublisher).Conn()
	inbox := nats.NewInbox()
	// Room for every answer there can be (a flow acknowledgement per message at most, gaps,
	// errors, the final one), so that none is dropped as a slow consumer's.
	answers := make(chan *nats.Msg, 2*len(msgs)+8)
	sub, err := nc.ChanSubscribe(inbox+".>", answers)
	if err != nil {
		return 0, fmt.Errorf("publish a batch of %d changes: subscribe to its answers: %w", len(msgs), err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	id := strings.TrimPrefix(nats.NewInbox(), nats.InboxPrefix) // a unique token
	for i, m := range msgs {
		op := 1 // append
		switch {
		case i == 0:
			op = 0 // start
		case i == len(msgs)-1:
			op = 2 // commit
		}
		msg := m.nats()
		msg.Reply = fmt.Sprintf("%s.%s.%d.fail.%d.%d.$FI", inbox, id, fastBatchFlow, i+1, op)
		if err := nc.PublishMsg(msg); err != nil {
			return 0, fmt.Errorf("publish change %s to %s in a batch: %w", m.id, m.subject, err)
		}
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var firstErr string
	for {
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-timer.C:
			return 0, fmt.Errorf("publish a batch of %d changes to %s: no final answer within %s", len(msgs), msgs[0].subject, timeout)
		case m := <-answers:
			var a batchAnswer
			if err := json.Unmarshal(m.Data, &a); err != nil {
				return 0, fmt.Errorf("publish a batch of %d changes to %s: unreadable answer %q", len(msgs), msgs[0].subject, m.Data)
			}
			switch {
			case a.Type == "err" && a.Error != nil && firstErr == "":
				firstErr = a.Error.Description
			case a.Type != "":
				// a flow acknowledgement or a gap: the final answer follows
			case a.Error != nil:
				// refused outright (e.g. the first message): nothing of it is known stored
				return 0, fmt.Errorf("publish a batch of %d changes to %s: %s", len(msgs), msgs[0].subject, a.Error.Description)
			case a.Batch != id:
				return 0, fmt.Errorf("publish a batch of %d changes to %s: answer of another batch %q", len(msgs), msgs[0].subject, a.Batch)
			default:
				n := min(a.Count, len(msgs))
				p.published(n)
				if n < len(msgs) {
					return n, fmt.Errorf("publish a batch of %d changes to %s: the stream stored the first %d (%s)", len(msgs), msgs[0].subject, n, firstErr)
				}
				return n, nil
			}
		}
	}
}
