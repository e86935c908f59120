// Package status is what each Spiegel process says about itself over NATS: a NATS micro service
// per process (spiegel-producer, spiegel-replicator, spiegel-onchange) whose `status` endpoint
// answers a Report, the in-memory per-rule figures the consumers keep for it (Recorder), and
// Collect, which gathers the answers of every running instance for `producer status`. It keeps
// nothing on disk and writes nothing per change.
package status

import (
	"time"
)

// Report is one process's answer on its status endpoint.
type Report struct {
	Service   string            `json:"service"`   // the micro service name: spiegel-producer
	Component string            `json:"component"` // ComponentProducer, ComponentReplicator or ComponentOnChange
	ID        string            `json:"id"`        // the micro instance id
	Version   string            `json:"version"`   // the build's version
	Host      string            `json:"host,omitempty"`
	Started   time.Time         `json:"started"`
	Rules     RuleCounts        `json:"rules"`
	InFlight  int               `json:"jobs_in_flight"`
	Jobs      map[string]uint64 `json:"jobs,omitempty"` // consumers: jobs settled by result since start
	LastError *ErrorNote        `json:"last_error,omitempty"`
	// Producer is set by producers only.
	Producer *ProducerState `json:"producer,omitempty"`
	// DefaultEngine is the replicators' engine of rules that name none.
	DefaultEngine string `json:"default_engine,omitempty"`
	// RuleStats are the consumers' figures per rule id, for the rules they ran since start.
	RuleStats map[string]RuleStats `json:"rule_stats,omitempty"`
}

// RuleCounts are the rules a process has loaded.
type RuleCounts struct {
	Replicators int `json:"replicators"`
	OnChanges   int `json:"on_changes"`
	Disabled    int `json:"disabled"`
	Rejected    int `json:"rejected"`
}

// ErrorNote is a process's last error: when, for which rule (if any), and its redacted text.
type ErrorNote struct {
	At   time.Time `json:"at"`
	Rule string    `json:"rule,omitempty"`
	Text string    `json:"error"`
}

// ProducerState is the producer's own part of its Report.
type ProducerState struct {
	Source   string `json:"source,omitempty"`   // db_updates, global_changes or poll
	Position string `json:"position,omitempty"` // every job up to it is acknowledged by JetStream
	FeedOK   bool   `json:"feed_ok"`            // the db-updates feed runs
	HotFeeds int    `json:"hot_feeds"`
	// StreamLoss is the last time the changes stream was found to have lost messages it had
	// acknowledged, and how (nil: never since start).
	StreamLoss *ErrorNote `json:"stream_loss,omitempty"`
}

// RuleStats are one rule's figures in one consumer process.
type RuleStats struct {
	LastRun          time.Time `json:"last_run"`
	LastResult       string    `json:"last_result"`
	LastError        string    `json:"last_error,omitempty"`
	Runs             uint64    `json:"runs"`
	Failures         uint64    `json:"failures"`
	FailuresLastHour int       `json:"failures_last_hour"`
	// Gaps counts the gaps found in what the rule keeps for readers (a change stream's subject, a
	// mirror bucket); LastGap is the latest, naming the db and the range.
	Gaps    uint64   `json:"gaps,omitempty"`
	LastGap *GapNote `json:"last_gap,omitempty"`
}

// GapNote is a gap found in what a rule keeps for readers: when, in which db, and what is missing.
type GapNote struct {
	At   time.Time `json:"at"`
	DB   string    `json:"db"`
	Text string    `json:"gap"`
}

// Results of one rule's run in one db, as RuleRun records them.
const (
	ResultOK            = "ok"             // done: replicated, or every change acted on
	ResultMissingSource = "missing_source" // the db does not exist: nothing to do
	ResultDeferred      = "deferred"       // a request waits for its retry: the rule stopped at that change
	ResultError         = "error"          // failed transiently: the job runs again
	ResultFailed        = "failed"         // given up: a dead letter was recorded
)

// IsFailure reports whether result counts as a failure (deferred, error, failed).
func IsFailure(result string) bool {
	return result == ResultDeferred || result == ResultError || result == ResultFailed
}

// Components of Spiegel, the last part of their service names.
const (
	ComponentProducer   = "producer"
	ComponentReplicator = "replicator"
	ComponentOnChange   = "onchange"
)

// Components lists every component in a stable order.
var Components = []string{ComponentProducer, ComponentReplicator, ComponentOnChange}
