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

// batchPublisher is the part of jetstream.JetStream that fenced and atomic publishes use besides
// streamPublisher's (stream info, and the connection for reads at the stream leader and atomic
// batches): a publisher without it publishes one change at a time, unfenced.
type batchPublisher interface {
	Stream(ctx context.Context, name string) (jetstream.Stream, error)
	Conn() *nats.Conn
}

// changePublisher publishes changes for `subject` rules (SPEC §3): the change JSON with message
// id <db>/<doc id>/<rev> (on a subject other than the db's own, the subject is named in the id:
// events.Subjects.ChangeMsgIDOn), so that a re-dispatch is deduplicated by the stream (a
// replay's messages have their own ids, see events.ReplayMsgID). Safe for concurrent use. Its
// memory is bounded whatever the number of dbs.
type changePublisher struct {
	js       streamPublisher
	metrics  *metrics.Consumer
	subjects events.Subjects // the prefix's, for the db's own subject

	checked *expiringSet // subjects found captured by a stream, with the stream's name
	atomic  *expiringSet // those of them whose stream takes a page as one atomic batch (see publishAtomic)

	streamsRead, atomicStreams *expiringSet // stream names whose info was read; those taking atomic batches
	consumed                   *expiringSet // stream names whose readers remove messages (WorkQueue, Interest): not fenced
	clustered                  *expiringSet // stream names of a JetStream cluster: no windows (see windowSize)
	reported                   *expiringSet // rule id, rev and subject already dead-lettered as unusable

	atomicOnFile bool // tests and benchmarks: atomic pages on a single-replica file stream too

	sendMu  sync.Mutex
	sending map[string]*sync.Mutex // by stream: held while a window is sent (see publishWindow)
	// lastSent: by stream, the fence of the job whose window the process sent to it last (read
	// and written under the stream's sending lock)
	lastSent map[string]*fence
}

func newChangePublisher(js streamPublisher, m *metrics.Consumer, subjects events.Subjects) *changePublisher {
	return &changePublisher{js: js, metrics: m, subjects: subjects,
		checked: newExpiringSet(subjectCheckTTL, publisherMemory), atomic: newExpiringSet(subjectCheckTTL, publisherMemory),
		reported:    newExpiringSet(reportedTTL, publisherMemory),
		streamsRead: newExpiringSet(subjectCheckTTL, publisherMemory), atomicStreams: newExpiringSet(subjectCheckTTL, publisherMemory),
		// outlives checked, which is put after it: a subject found captured is never taken for fenced
		consumed:  newExpiringSet(2*subjectCheckTTL, publisherMemory),
		clustered: newExpiringSet(2*subjectCheckTTL, publisherMemory)}
}

// subject returns rule's subject for db: ${db_name} becomes the db's subject token
// (events.EncodeDBName), so any db name gives one valid token.
func subjectFor(rule *rules.OnChange, db string) string {
	return rules.Interpolate(rule.Subject, rules.Vars{DBName: events.EncodeDBName(db)}, false)
}

// check reports whether some stream captures rule's subject for db, and notes the stream's name
// and whether it takes a page as one atomic batch (see publishAtomic). When none does, the rule cannot run in
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
				info := st.CachedInfo()
				cfg := info.Config
				if takesAtomicPages(cfg) || p.atomicOnFile && cfg.AllowAtomicPublish {
					p.atomicStreams.add(name)
				}
				if cfg.Replicas > 1 || info.Cluster != nil && info.Cluster.Name != "" {
					p.clustered.add(name)
				}
				if cfg.Retention != jetstream.LimitsPolicy {
					p.consumed.add(name)
				}
				p.streamsRead.add(name)
			}
			if p.atomicStreams.has(name) {
				p.atomic.add(subject)
			}
		}
		p.checked.put(subject, name)
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
	subject := subjectFor(rule, db)
	id := p.subjects.ChangeMsgIDOn(subject, db, c.ID, c.rev())
	if replay != "" {
		id = events.ReplayMsgID(replay, id)
	}
	return changeMsg{subject: subject, id: id, replay: replay, data: data}, nil
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

// expiringSet is a set of strings, each with an optional value, whose entries expire after ttl,
// holding at most max entries (see put). Safe for concurrent use.
type expiringSet struct {
	mu  sync.Mutex
	ttl time.Duration
	max int
	at  map[string]expiringEntry
	now func() time.Time
}

type expiringEntry struct {
	at  time.Time
	val string
}

func newExpiringSet(ttl time.Duration, max int) *expiringSet {
	return &expiringSet{ttl: ttl, max: max, at: map[string]expiringEntry{}, now: time.Now}
}

// has reports whether key was added less than ttl ago.
func (s *expiringSet) has(key string) bool {
	_, ok := s.get(key)
	return ok
}

// get returns key's value if key was added less than ttl ago.
func (s *expiringSet) get(key string) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.at[key]
	if !ok || s.now().Sub(e.at) >= s.ttl {
		return "", false
	}
	return e.val, true
}

// add records key as of now.
func (s *expiringSet) add(key string) { s.put(key, "") }

// put records key with val as of now. A full set first drops its expired entries, then, if that
// was not enough, arbitrary ones down to three quarters of max.
func (s *expiringSet) put(key, val string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if _, ok := s.at[key]; !ok && len(s.at) >= s.max {
		for k, e := range s.at {
			if now.Sub(e.at) >= s.ttl {
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
	s.at[key] = expiringEntry{at: now, val: val}
}

// firstTime adds key and reports whether it was not held already (or had expired).
func (s *expiringSet) firstTime(key string) bool {
	s.mu.Lock()
	e, ok := s.at[key]
	held := ok && s.now().Sub(e.at) < s.ttl
	s.mu.Unlock()
	if !held {
		s.add(key)
	}
	return !held
}

// len returns the number of entries held (expired ones included until swept).
func (s *expiringSet) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.at)
}
