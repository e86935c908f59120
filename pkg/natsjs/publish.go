package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// ErrCodeStoreFailed is the JetStream error code of a publish the stream failed to store. The
// work stream's per-subject rejection ("a job for this (group, db) is already pending") carries
// it, and so do a full stream (max msgs, max bytes), a disk error and a closed store: the code
// alone does not tell a duplicate from a lost job.
const ErrCodeStoreFailed jetstream.ErrorCode = 10077

// perSubjectLimit is the description of the per-subject rejection (nats-server's
// ErrMaxMsgsPerSubject).
const perSubjectLimit = "maximum messages per subject exceeded"

// IsDuplicateJob reports whether err is the work stream's per-subject rejection: error code
// 10077 with the description "maximum messages per subject exceeded". Every other error, 10077
// included, is a real failure: the job is not stored and must be published again.
func IsDuplicateJob(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == ErrCodeStoreFailed &&
		strings.Contains(strings.ToLower(apiErr.Description), perSubjectLimit)
}

// Jobs publishes jobs to the work stream and keeps their wakeup markers. It is safe for
// concurrent use.
type Jobs struct {
	js       jetstream.JetStream
	subjects events.Subjects
	rules    func() string // the publisher's rule-set seq, stamped on jobs (nil: none)

	mu           sync.Mutex
	wakeupStream jetstream.Stream // looked up once
}

// NewJobs returns a job publisher for the work stream named by subjects.
func NewJobs(js jetstream.JetStream, subjects events.Subjects) *Jobs {
	return &Jobs{js: js, subjects: subjects}
}

// WithRules returns j stamping every job that names no rule-set seq with rules() (events.Job
// Rules): the producer's rule follower's AppliedSeq.
func (j *Jobs) WithRules(rules func() string) *Jobs {
	out := &Jobs{js: j.js, subjects: j.subjects, rules: rules}
	return out
}

// Msg builds the message of a job for group g.
func (j *Jobs) Msg(g events.Group, job events.Job) *nats.Msg {
	if job.At.IsZero() {
		job.At = time.Now().UTC()
	}
	if job.Rules == "" && j.rules != nil {
		job.Rules = j.rules()
	}
	return &nats.Msg{Subject: j.subjects.Work(g, job.DB), Data: job.Marshal()}
}

// Publish enqueues job for group g and waits for JetStream's answer. It returns deduplicated
// true when a job for the same (group, db) was already pending, which is as good as a new one.
func (j *Jobs) Publish(ctx context.Context, g events.Group, job events.Job) (deduplicated bool, err error) {
	_, err = j.js.PublishMsg(ctx, j.Msg(g, job), jetstream.WithExpectStream(j.subjects.WorkStream()))
	if err == nil {
		return false, nil
	}
	if IsDuplicateJob(err) {
		return true, nil
	}
	return false, fmt.Errorf("publish %s job for %q: %w", g, job.DB, err)
}

// PublishAsync enqueues job for group g without waiting; the future reports the answer, to be
// read with IsDuplicateJob in mind. When the connection's window of unacknowledged publishes is
// full it waits for room (up to about a minute), which is the back-pressure callers want.
func (j *Jobs) PublishAsync(g events.Group, job events.Job) (jetstream.PubAckFuture, error) {
	msg := j.Msg(g, job)
	for attempt := 0; ; attempt++ {
		f, err := j.js.PublishMsgAsync(msg, jetstream.WithExpectStream(j.subjects.WorkStream()))
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) || attempt >= 300 {
			return nil, fmt.Errorf("publish %s job for %q: %w", g, job.DB, err)
		}
	}
}

// The lost-wakeup rule (SPEC §3) without asking CouchDB. A change that lands while its db's job
// is pending or running is refused as a duplicate; Offer then leaves a wakeup marker for the
// (group, db) and publishes once more, so that a job acked between the refusal and the marker is
// enqueued anyway. A worker reads the marker after it settled the job (ack or term) and never
// deletes a marker before a job that covers it is stored:
//
//   - no marker: nothing more to do (one API request: the read);
//   - the marker the job was offered for (its WakeupHeader): the run covered it, the worker
//     deletes it by its sequence, which leaves a newer marker in place;
//   - any other marker: the worker offers the job again, carrying the marker's sequence
//     (OfferWakeup), and leaves the marker; the next run deletes it.
//
// So at every moment a change is represented by a pending job, a running job that will read the
// marker, or a marker. A marker whose job is gone (the worker died or lost NATS between the read
// and the offer) stands for a change its db's completion record does not cover: the producer's
// reconciliation sweep enqueues the db, and that job's check finds the marker.

// WakeupHeader carries, on a job offered because of a wakeup marker, the marker's stream
// sequence: the run of that job covers the marker, which may then be deleted.
const WakeupHeader = "Spiegel-Wakeup-Seq"

// Offer enqueues job for group g. When a job for the same (group, db) is already pending or
// running, it writes the wakeup marker and publishes once more; deduplicated is true when that
// second publish was refused too (the marker stands for the change). An error means the change
// is not represented yet: the caller retries.
func (j *Jobs) Offer(ctx context.Context, g events.Group, job events.Job) (deduplicated bool, err error) {
	dedup, err := j.Publish(ctx, g, job)
	if err != nil || !dedup {
		return false, err
	}
	return j.MarkAndRetry(ctx, g, job)
}

// MarkAndRetry is what Offer does after a refused publish (for a caller that published
// asynchronously and saw the refusal in the answer): write the wakeup marker, publish again. A
// job stored by that second publish carries the marker's sequence: its run covers the marker.
func (j *Jobs) MarkAndRetry(ctx context.Context, g events.Group, job events.Job) (deduplicated bool, err error) {
	subject := j.subjects.Wakeup(g, job.DB)
	if job.Rules == "" && j.rules != nil {
		job.Rules = j.rules()
	}
	// The marker carries the job's rule-set seq: the job offered for it runs with rules at
	// least as new (Wakeup.Rules).
	ack, err := j.js.Publish(ctx, subject, []byte(job.Rules), jetstream.WithExpectStream(j.subjects.WakeupStream()))
	if err != nil {
		return false, fmt.Errorf("write wakeup marker %s: %w", subject, err)
	}
	return j.publishWakeup(ctx, g, job, ack.Sequence)
}

// OfferWakeup enqueues the job of (g, db) for the wakeup marker m (m.Seq 0: for a marker that
// could not be read), carrying the marker's rule-set seq. deduplicated is true when a job for
// (g, db) is already pending or running: that job reads the marker after its run, so nothing
// more is needed.
func (j *Jobs) OfferWakeup(ctx context.Context, g events.Group, db string, m Wakeup) (deduplicated bool, err error) {
	return j.publishWakeup(ctx, g, events.Job{DB: db, Reason: events.ReasonWakeup, Rules: m.Rules}, m.Seq)
}

// Wakeup is a wakeup marker: its stream sequence (0: none) and the rule-set seq of the job it
// stands for ("": not known).
type Wakeup struct {
	Seq   uint64
	Rules string
}

func (j *Jobs) publishWakeup(ctx context.Context, g events.Group, job events.Job, seq uint64) (bool, error) {
	msg := j.Msg(g, job)
	if seq > 0 {
		msg.Header = nats.Header{WakeupHeader: []string{strconv.FormatUint(seq, 10)}}
	}
	_, err := j.js.PublishMsg(ctx, msg, jetstream.WithExpectStream(j.subjects.WorkStream()))
	if err == nil {
		return false, nil
	}
	if IsDuplicateJob(err) {
		return true, nil
	}
	return false, fmt.Errorf("publish %s job for %q: %w", g, job.DB, err)
}

// WakeupSeq returns the marker sequence a job message carries (WakeupHeader), 0 when none.
func WakeupSeq(h nats.Header) uint64 {
	seq, err := strconv.ParseUint(h.Get(WakeupHeader), 10, 64)
	if err != nil {
		return 0
	}
	return seq
}

// ReadWakeup returns the wakeup marker of (g, db), Seq 0 when there is none. It reads at the
// stream leader (one API request, no write): a marker stored before the call is seen. A failure
// to tell is an error; the caller offers the job again to be safe.
func (j *Jobs) ReadWakeup(ctx context.Context, g events.Group, db string) (Wakeup, error) {
	s, err := j.wakeups(ctx)
	if err != nil {
		return Wakeup{}, fmt.Errorf("read wakeup marker of %s %q: %w", g, db, err)
	}
	m, err := s.GetLastMsgForSubject(ctx, j.subjects.Wakeup(g, db))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return Wakeup{}, nil
	}
	if err != nil {
		return Wakeup{}, fmt.Errorf("read wakeup marker of %s %q: %w", g, db, err)
	}
	return Wakeup{Seq: m.Sequence, Rules: string(m.Data)}, nil
}

// ClearWakeup deletes the wakeup marker of (g, db) at stream sequence seq, which a settled run
// covered. A newer marker has another sequence and stays. A failure is harmless (the sweep
// offers the job once more than needed) and is returned for logging.
func (j *Jobs) ClearWakeup(ctx context.Context, g events.Group, db string, seq uint64) error {
	s, err := j.wakeups(ctx)
	if err == nil {
		err = s.DeleteMsg(ctx, seq)
	}
	if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("clear wakeup marker %d of %s %q: %w", seq, g, db, err)
	}
	return nil
}

func (j *Jobs) wakeups(ctx context.Context) (jetstream.Stream, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.wakeupStream != nil {
		return j.wakeupStream, nil
	}
	s, err := j.js.Stream(ctx, j.subjects.WakeupStream())
	if err != nil {
		return nil, err
	}
	j.wakeupStream = s
	return s, nil
}
