package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strings"
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

// Jobs publishes jobs to the work stream.
type Jobs struct {
	js       jetstream.JetStream
	subjects events.Subjects
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
