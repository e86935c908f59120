package events

import (
	"encoding/json"
	"fmt"
	"time"
)

// Event types of a db-updates feed, and the job reasons that are not feed events.
const (
	TypeCreated = "created"
	TypeUpdated = "updated"
	TypeDeleted = "deleted"
	// ReasonRule marks a job enqueued because a rule was added or edited.
	ReasonRule = "rule"
	// ReasonResync marks a job enqueued by `producer resync` or `producer replay`.
	ReasonResync = "resync"
	// ReasonSweep marks a job enqueued by the reconciliation sweep.
	ReasonSweep = "sweep"
	// ReasonWakeup marks a job republished by the lost-wakeup check of a consumer.
	ReasonWakeup = "wakeup"
)

// Job is the payload of a work message. It is a hint: the subject alone says which db has
// changes; the consumer always reads the db's own state (checkpoints, _changes) to decide what
// to do. Seq is the opaque feed sequence that caused the job, if any; never parse it.
//
// Rules is the spiegel db seq up to which the publisher's rule set had applied every rule
// change when it published the job (rulefeed.Follower.AppliedSeq; "": not known). A consumer
// runs the job only with a rule set at least that new (rulefeed.Follower.Await), so that a job
// enqueued for a new or edited rule is never run, and acked, by an instance that does not know
// the rule yet. Opaque like Seq.
type Job struct {
	DB     string    `json:"db"`
	Reason string    `json:"reason,omitempty"`
	Seq    string    `json:"seq,omitempty"`
	Rules  string    `json:"rules,omitempty"`
	At     time.Time `json:"at"`
}

// Marshal encodes the job as JSON.
func (j Job) Marshal() []byte {
	b, _ := json.Marshal(j) // a struct of strings and a time cannot fail to encode
	return b
}

// UnmarshalJob decodes a job payload.
func UnmarshalJob(data []byte) (Job, error) {
	var j Job
	if err := json.Unmarshal(data, &j); err != nil {
		return Job{}, fmt.Errorf("decode job: %w", err)
	}
	return j, nil
}
