package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
)

// DeadLetter is the JSON record of work given up, published on
// <prefix>.deadletter.<group>.<dbtoken> into the dead-letter stream. Error must never contain
// secrets: callers pass errors whose URLs are already redacted.
type DeadLetter struct {
	Group    events.Group   `json:"group"`
	DB       string         `json:"db"`
	Rule     string         `json:"rule,omitempty"`
	Seq      string         `json:"seq,omitempty"`
	Since    string         `json:"since,omitempty"` // on_change: the seq just before Seq, where a re-drive resumes
	DocID    string         `json:"doc_id,omitempty"`
	Status   int            `json:"status,omitempty"`
	Error    string         `json:"error"`
	Attempts int            `json:"attempts,omitempty"`
	At       time.Time      `json:"at"`
	Details  map[string]any `json:"details,omitempty"`
}

// deadLetterAttempts bounds the publish attempts of one record.
const deadLetterAttempts = 4

// DeadLetters publishes dead-letter records. It is safe for concurrent use.
type DeadLetters struct {
	js       jetstream.JetStream
	subjects events.Subjects
}

// NewDeadLetters returns a publisher into the dead-letter stream named by subjects.
func NewDeadLetters(js jetstream.JetStream, subjects events.Subjects) *DeadLetters {
	return &DeadLetters{js: js, subjects: subjects}
}

// Publish stores rec in the dead-letter stream and returns only once the stream acknowledged it,
// retrying a few times (about 2s in all) within ctx. A zero At is set to now. An error means the
// record is not stored: the caller must not consider the work given up silently.
func (d *DeadLetters) Publish(ctx context.Context, rec DeadLetter) error {
	if rec.At.IsZero() {
		rec.At = time.Now().UTC()
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("encode dead letter for %s %q: %w", rec.Group, rec.DB, err)
	}
	subject := d.subjects.DeadLetter(rec.Group, rec.DB)
	retry := backoff.Policy{Initial: 250 * time.Millisecond, Max: 2 * time.Second, Multiplier: 2, Jitter: 0.2}
	for attempt := 1; ; attempt++ {
		_, err = d.js.Publish(ctx, subject, data, jetstream.WithExpectStream(d.subjects.DeadLetterStream()))
		if err == nil {
			return nil
		}
		if attempt == deadLetterAttempts || backoff.Sleep(ctx, retry.Delay(attempt)) != nil {
			return fmt.Errorf("publish dead letter for %s %q: %w", rec.Group, rec.DB, err)
		}
	}
}
