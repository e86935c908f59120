package events

import (
	"fmt"
	"strings"
)

// Group names one consumer group of the work stream. The group is the subject token after
// "<prefix>.work."; the durable consumer that serves it has its own name (ConsumerName).
type Group string

// The two consumer groups.
const (
	GroupReplicate Group = "replicate"
	GroupOnChange  Group = "onchange"
)

// Groups lists every group, in a stable order.
var Groups = []Group{GroupReplicate, GroupOnChange}

// ConsumerName is the durable JetStream consumer of the group (SPEC §3).
func (g Group) ConsumerName() string {
	if g == GroupReplicate {
		return "replicator"
	}
	return string(g)
}

// Default names, used when the configuration does not say otherwise.
const (
	DefaultPrefix = "spiegel"
)

// Subjects derives every subject and stream name from the subject prefix.
type Subjects struct {
	Prefix string
}

// NewSubjects returns the scheme for prefix (DefaultPrefix when empty).
func NewSubjects(prefix string) Subjects {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	return Subjects{Prefix: prefix}
}

// streamBase is the prefix in upper case with characters invalid in stream names replaced.
func (s Subjects) streamBase() string {
	up := strings.ToUpper(s.Prefix)
	return strings.Map(func(r rune) rune {
		if r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' {
			return r
		}
		return '_'
	}, up)
}

// WorkStream is the work queue stream: SPIEGEL_WORK for the default prefix.
func (s Subjects) WorkStream() string { return s.streamBase() + "_WORK" }

// ChangesStream captures the changes published by `subject` rules: SPIEGEL_CHANGES.
func (s Subjects) ChangesStream() string { return s.streamBase() + "_CHANGES" }

// OnChangeBucket is the key-value bucket caching the checkpoints of on_change rules:
// SPIEGEL_ONCHANGE (its stream is KV_SPIEGEL_ONCHANGE).
func (s Subjects) OnChangeBucket() string { return s.streamBase() + "_ONCHANGE" }

// DoneBucket is the key-value bucket of completion records, one per (group, db): the position of
// the db's changes feed that a job of the group last processed everything up to (see package
// reconcile): SPIEGEL_DONE (its
// stream is KV_SPIEGEL_DONE).
func (s Subjects) DoneBucket() string { return s.streamBase() + "_DONE" }

// WakeupStream keeps the wakeup markers: SPIEGEL_WAKEUPS (see natsjs.Jobs.Offer).
func (s Subjects) WakeupStream() string { return s.streamBase() + "_WAKEUPS" }

// WakeupAll is the wakeup stream's subject filter.
func (s Subjects) WakeupAll() string { return s.Prefix + ".wakeup.>" }

// Wakeup is the subject of the wakeup marker of group g and db.
func (s Subjects) Wakeup(g Group, db string) string {
	return s.Prefix + ".wakeup." + string(g) + "." + EncodeDBName(db)
}

// LeaseStream holds one lease message per (group, db) whose job runs (worker's claim): with a
// time to live, replaced by compare-and-set on its subject. SPIEGEL_LEASES.
func (s Subjects) LeaseStream() string { return s.streamBase() + "_LEASES" }

// LeaseAll is the lease stream's subject filter.
func (s Subjects) LeaseAll() string { return s.Prefix + ".lease.>" }

// Lease is the subject of the lease of (g, db).
func (s Subjects) Lease(g Group, db string) string {
	return s.Prefix + ".lease." + string(g) + "." + EncodeDBName(db)
}

// DeadLetterStream keeps records of work given up: SPIEGEL_DEADLETTER.
func (s Subjects) DeadLetterStream() string { return s.streamBase() + "_DEADLETTER" }

// WorkAll is the work stream's subject filter.
func (s Subjects) WorkAll() string { return s.Prefix + ".work.>" }

// WorkGroup is the subject filter of one group's consumer.
func (s Subjects) WorkGroup(g Group) string { return fmt.Sprintf("%s.work.%s.*", s.Prefix, g) }

// Work is the subject of the job "db has changes group has not processed".
func (s Subjects) Work(g Group, db string) string {
	return s.Prefix + ".work." + string(g) + "." + EncodeDBName(db)
}

// ParseWork splits a work subject into its group and db name.
func (s Subjects) ParseWork(subject string) (Group, string, error) {
	rest, ok := strings.CutPrefix(subject, s.Prefix+".work.")
	if !ok {
		return "", "", fmt.Errorf("parse work subject %q: not under %s.work", subject, s.Prefix)
	}
	group, token, ok := strings.Cut(rest, ".")
	if !ok || strings.Contains(token, ".") {
		return "", "", fmt.Errorf("parse work subject %q: want <group>.<dbtoken>", subject)
	}
	db, err := DecodeDBName(token)
	if err != nil {
		return "", "", fmt.Errorf("parse work subject %q: %w", subject, err)
	}
	return Group(group), db, nil
}

// DeadLetterAll is the dead-letter stream's subject filter.
func (s Subjects) DeadLetterAll() string { return s.Prefix + ".deadletter.>" }

// DeadLetter is the subject of a dead-letter record for group and db.
func (s Subjects) DeadLetter(g Group, db string) string {
	return s.Prefix + ".deadletter." + string(g) + "." + EncodeDBName(db)
}

// ChangesAll is the changes stream's subject filter.
func (s Subjects) ChangesAll() string { return s.Prefix + ".changes.>" }

// DefaultChangeSubject is the subject template of a `subject` rule that names none.
func (s Subjects) DefaultChangeSubject() string { return s.Prefix + ".changes.${db_name}" }

// ChangeMsgID is the JetStream message id of a change published to the db's own subject
// (<prefix>.changes.<db token>), so that a re-dispatch deduplicates.
func ChangeMsgID(db, docID, rev string) string { return db + "/" + docID + "/" + rev }

// ChangeSubject is the db's own change subject: DefaultChangeSubject for db.
func (s Subjects) ChangeSubject(db string) string { return s.Prefix + ".changes." + EncodeDBName(db) }

// ChangeMsgIDOn is the message id of a change of db published to subject: ChangeMsgID on the
// db's own subject (SPEC §3), and on any other subject the same after "@<subject>/". A stream
// deduplicates by message id across all its subjects, so two rules that publish one change to
// two subjects of one stream need two ids, or the second copy is dropped as a duplicate of the
// first; one rule's re-dispatch still has the id of its first publish. No db name starts with
// '@', so the two forms never meet.
func (s Subjects) ChangeMsgIDOn(subject, db, docID, rev string) string {
	id := ChangeMsgID(db, docID, rev)
	if subject == s.ChangeSubject(db) {
		return id
	}
	return "@" + subject + "/" + id
}

// ReplayHeader names, on a change published by `producer replay`, the replay that published it.
const ReplayHeader = "Spiegel-Replay"

// ReplayMsgID is the JetStream message id of a change published again by replay: its first
// publication's id (ChangeMsgIDOn) in the replay's own namespace, so that the stream
// deduplicates the replay's messages among themselves (a retried or concurrent run of the same
// replay) but not against the first publication or another replay.
func ReplayMsgID(replay, id string) string { return "replay/" + replay + "/" + id }

// PositionHeader carries, on a change published to a db's own subject, the message's position
// on its subject: 1 for the subject's first message, one more for each message after it. A
// subject that holds fewer messages than its last one's position says, and not because the
// stream dropped the oldest by its limits, lost messages in the middle.
const PositionHeader = "Spiegel-Subject-Position"

// PreviousHeader carries, on a change published to a db's own subject, the stream sequence of
// the subject's last message when it was published (0: none): the message before it, or, in an
// atomic batch, the message before the batch. A subject whose first message names a previous one
// that the stream's limits cannot have dropped (at or after the stream's first sequence) lost its
// oldest messages.
const PreviousHeader = "Spiegel-Subject-Previous"
