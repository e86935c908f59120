package natsjs

import (
	"context"
	"errors"
	"fmt"
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

	mu           sync.Mutex
	wakeupStream jetstream.Stream // looked up once
}

// NewJobs returns a job publisher for the work stream named by subjects.
func NewJobs(js jetstream.JetStream, subjects events.Subjects) *Jobs {
	return &Jobs{js: js, subjects: subjects}
}

// Msg builds the message of a job for group g.
func (j *Jobs) Msg(g events.Group, job events.Job) *nats.Msg {
	if job.At.IsZero() {
		job.At = time.Now().UTC()
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
// (group, db). A worker clears the marker when it starts the db's job (whatever it marked is
// read by that run) and takes it after the ack: a marker still there came during the run, so
// the job is offered again. Offer publishes once more after writing the marker, so that a job
// acked between the refusal and the marker is enqueued anyway: whichever way the two race, the
// change is covered by the running job, the job offered again, or the job this second publish
// enqueues.

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
// asynchronously and saw the refusal in the answer): write the wakeup marker, publish again.
func (j *Jobs) MarkAndRetry(ctx context.Context, g events.Group, job events.Job) (deduplicated bool, err error) {
	subject := j.subjects.Wakeup(g, job.DB)
	if _, err := j.js.Publish(ctx, subject, nil, jetstream.WithExpectStream(j.subjects.WakeupStream())); err != nil {
		return false, fmt.Errorf("write wakeup marker %s: %w", subject, err)
	}
	return j.Publish(ctx, g, job)
}

// ClearWakeup removes the wakeup marker of (g, db): the job about to run reads everything it
// stood for. A failure is harmless (TakeWakeup then finds the old marker and the job is
// offered once more than needed) and is returned for logging.
func (j *Jobs) ClearWakeup(ctx context.Context, g events.Group, db string) error {
	s, err := j.wakeups(ctx)
	if err == nil {
		err = s.Purge(ctx, jetstream.WithPurgeSubject(j.subjects.Wakeup(g, db)))
	}
	if err != nil {
		return fmt.Errorf("clear wakeup marker of %s %q: %w", g, db, err)
	}
	return nil
}

// TakeWakeup reports whether the wakeup marker of (g, db) is set, and removes it. A failure
// to tell is an error; the caller offers the job again to be safe.
func (j *Jobs) TakeWakeup(ctx context.Context, g events.Group, db string) (bool, error) {
	s, err := j.wakeups(ctx)
	if err != nil {
		return false, fmt.Errorf("read wakeup marker of %s %q: %w", g, db, err)
	}
	m, err := s.GetLastMsgForSubject(ctx, j.subjects.Wakeup(g, db))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read wakeup marker of %s %q: %w", g, db, err)
	}
	// A newer marker replaces this one (one per subject): deleting an old sequence number that
	// is gone already is fine.
	if err := s.DeleteMsg(ctx, m.Sequence); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return true, fmt.Errorf("remove wakeup marker of %s %q: %w", g, db, err)
	}
	return true, nil
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
