package admin

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// difference is one setting of an existing stream, key-value bucket or consumer that is not what
// install would create it with.
type difference struct {
	setting    string // as nats CLI's JSON names it: max_age, max_ack_pending, ...
	have, want string
	// fixed: JetStream cannot change it on an existing stream or consumer.
	fixed bool
}

// setting is one setting of a configuration C that install compares. Only the settings our
// configurations set are compared, after the defaults JetStream fills in (a max_msgs of 0 is
// stored as -1, a duplicate window of 0 as 2m), so that a stream install created and nobody
// touched shows no difference.
type setting[C any] struct {
	name  string
	value func(C) string
	// fixed reports whether JetStream refuses to change have into want in place (nil: never).
	fixed func(have, want C) bool
	// skip reports a want that leaves the setting to JetStream's default (nil: never).
	skip  func(want C) bool
	apply func(dst *C, want C)
}

// diff lists the settings in which have differs from want.
func diff[C any](settings []setting[C], have, want C) []difference {
	var out []difference
	for _, s := range settings {
		if s.skip != nil && s.skip(want) {
			continue
		}
		h, w := s.value(have), s.value(want)
		if h == w {
			continue
		}
		out = append(out, difference{setting: s.name, have: h, want: w, fixed: s.fixed != nil && s.fixed(have, want)})
	}
	return out
}

// applyChangeable returns have with every setting of diffs that JetStream can change in place
// set to want's, and everything else (the operator's other settings included) as it is.
func applyChangeable[C any](settings []setting[C], have, want C, diffs []difference) C {
	for _, d := range diffs {
		if d.fixed {
			continue
		}
		for _, s := range settings {
			if s.name == d.setting {
				s.apply(&have, want)
			}
		}
	}
	return have
}

// changeable reports whether any of diffs can be applied in place.
func changeable(diffs []difference) bool {
	return slices.ContainsFunc(diffs, func(d difference) bool { return !d.fixed })
}

// streamSettings are the settings of the streams' configurations (natsjs.Topology).
var streamSettings = []setting[jetstream.StreamConfig]{
	{name: "subjects", value: func(c jetstream.StreamConfig) string { return list(c.Subjects) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.Subjects = w.Subjects }},
	{name: "retention", value: func(c jetstream.StreamConfig) string { return jsonName(c.Retention) },
		// Limits and interest turn into each other; a work queue stays one, and nothing becomes one.
		fixed: func(h, w jetstream.StreamConfig) bool {
			return h.Retention == jetstream.WorkQueuePolicy || w.Retention == jetstream.WorkQueuePolicy
		},
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.Retention = w.Retention }},
	storageSetting,
	{name: "discard", value: func(c jetstream.StreamConfig) string { return jsonName(c.Discard) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.Discard = w.Discard }},
	{name: "discard_new_per_subject", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.DiscardNewPerSubject) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) {
			d.DiscardNewPerSubject = w.DiscardNewPerSubject
		}},
	{name: "max_msgs_per_subject", value: func(c jetstream.StreamConfig) string { return limit(c.MaxMsgsPerSubject) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.MaxMsgsPerSubject = w.MaxMsgsPerSubject }},
	{name: "max_msgs", value: func(c jetstream.StreamConfig) string { return limit(c.MaxMsgs) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.MaxMsgs = w.MaxMsgs }},
	{name: "max_bytes", value: func(c jetstream.StreamConfig) string { return limit(c.MaxBytes) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.MaxBytes = w.MaxBytes }},
	{name: "max_age", value: func(c jetstream.StreamConfig) string { return age(c.MaxAge) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.MaxAge = w.MaxAge }},
	{name: "duplicate_window", value: func(c jetstream.StreamConfig) string { return c.Duplicates.String() },
		skip:  func(w jetstream.StreamConfig) bool { return w.Duplicates == 0 },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.Duplicates = w.Duplicates }},
	replicasSetting,
	{name: "allow_atomic", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.AllowAtomicPublish) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.AllowAtomicPublish = w.AllowAtomicPublish }},
}

// storageSetting and replicasSetting are settings of streams and of buckets alike.
var (
	storageSetting = setting[jetstream.StreamConfig]{name: "storage", value: func(c jetstream.StreamConfig) string { return jsonName(c.Storage) },
		fixed: func(_, _ jetstream.StreamConfig) bool { return true }}
	replicasSetting = setting[jetstream.StreamConfig]{name: "num_replicas", value: func(c jetstream.StreamConfig) string { return strconv.Itoa(max(c.Replicas, 1)) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.Replicas = w.Replicas }}
)

// bucketSettings are the settings of a key-value bucket's configuration, compared on its
// stream (bucketStream): nats.go's UpdateKeyValue would rewrite the whole stream, turning direct
// gets back on and undoing every other edit, so --update changes these on the stream instead.
var bucketSettings = []setting[jetstream.StreamConfig]{
	{name: "history", value: func(c jetstream.StreamConfig) string { return limit(c.MaxMsgsPerSubject) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.MaxMsgsPerSubject = w.MaxMsgsPerSubject }},
	storageSetting,
	replicasSetting,
	{name: "allow_direct", value: func(c jetstream.StreamConfig) string { return strconv.FormatBool(c.AllowDirect) },
		apply: func(d *jetstream.StreamConfig, w jetstream.StreamConfig) { d.AllowDirect = w.AllowDirect }},
}

// bucketStream is what bucketSettings compare of the stream of a bucket created with cfg: its
// reads go to the leader (natsjs.Object.Create turns direct gets off).
func bucketStream(cfg jetstream.KeyValueConfig) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name: "KV_" + cfg.Bucket, MaxMsgsPerSubject: max(int64(cfg.History), 1), Storage: cfg.Storage,
		Replicas: cfg.Replicas, AllowDirect: false,
	}
}

// consumerSettings are the settings of the work consumers' configuration
// (natsjs.Topology.ConsumerConfig).
var consumerSettings = []setting[jetstream.ConsumerConfig]{
	{name: "filter_subject", value: func(c jetstream.ConsumerConfig) string {
		return list(append([]string{c.FilterSubject}, c.FilterSubjects...))
	},
		apply: func(d *jetstream.ConsumerConfig, w jetstream.ConsumerConfig) {
			d.FilterSubject, d.FilterSubjects = w.FilterSubject, w.FilterSubjects
		}},
	{name: "ack_policy", value: func(c jetstream.ConsumerConfig) string { return jsonName(c.AckPolicy) },
		fixed: func(_, _ jetstream.ConsumerConfig) bool { return true }},
	{name: "deliver_policy", value: func(c jetstream.ConsumerConfig) string { return jsonName(c.DeliverPolicy) },
		fixed: func(_, _ jetstream.ConsumerConfig) bool { return true }},
	{name: "ack_wait", value: func(c jetstream.ConsumerConfig) string { return c.AckWait.String() },
		apply: func(d *jetstream.ConsumerConfig, w jetstream.ConsumerConfig) { d.AckWait = w.AckWait }},
	// A back-off replaces AckWait as the time after which an unacknowledged job is redelivered.
	{name: "backoff", value: func(c jetstream.ConsumerConfig) string { return durations(c.BackOff) },
		apply: func(d *jetstream.ConsumerConfig, w jetstream.ConsumerConfig) { d.BackOff = w.BackOff }},
	{name: "max_deliver", value: func(c jetstream.ConsumerConfig) string { return limit(int64(c.MaxDeliver)) },
		apply: func(d *jetstream.ConsumerConfig, w jetstream.ConsumerConfig) { d.MaxDeliver = w.MaxDeliver }},
	{name: "max_ack_pending", value: func(c jetstream.ConsumerConfig) string { return limit(int64(c.MaxAckPending)) },
		apply: func(d *jetstream.ConsumerConfig, w jetstream.ConsumerConfig) { d.MaxAckPending = w.MaxAckPending }},
	{name: "num_replicas", value: func(c jetstream.ConsumerConfig) string { return consumerReplicas(c.Replicas) },
		apply: func(d *jetstream.ConsumerConfig, w jetstream.ConsumerConfig) { d.Replicas = w.Replicas }},
}

// jsonName is the name JetStream's API gives a policy: "workqueue", "file", "new", "explicit".
func jsonName(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return strings.Trim(string(b), `"`)
}

// list renders a set of subjects, in order and without empties.
func list(subjects []string) string {
	s := slices.DeleteFunc(slices.Clone(subjects), func(s string) bool { return s == "" })
	slices.Sort(s)
	return strings.Join(s, ",")
}

// limit renders a count limit; 0 and -1 both mean none (JetStream stores 0 as -1).
func limit(n int64) string {
	if n <= 0 {
		return "unlimited"
	}
	return strconv.FormatInt(n, 10)
}

// age renders a max age; 0 means messages are kept forever.
func age(d time.Duration) string {
	if d == 0 {
		return "0s (forever)"
	}
	return d.String()
}

// durations renders a back-off list.
func durations(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none"
	}
	s := make([]string, len(ds))
	for i, d := range ds {
		s[i] = d.String()
	}
	return strings.Join(s, ",")
}

// consumerReplicas renders a consumer's replicas; 0 means as many as its stream.
func consumerReplicas(n int) string {
	if n == 0 {
		return "0 (as its stream)"
	}
	return strconv.Itoa(n)
}
