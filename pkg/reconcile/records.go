// Package reconcile heals what NATS loses from what CouchDB holds (SPEC §3 "CouchDB is the
// truth, NATS an accelerator"; §7.7).
//
// JetStream may lose messages it acknowledged: a power failure with lazy fsync rolls a store
// back, a truncated store on a node loses its tail, an operator deletes a stream. A lost job,
// wakeup marker or consumer state would leave its db's changes unprocessed until the db is
// written again. So every (group, db) keeps a completion record in a key-value bucket: the
// position of the db's changes feed that the group's last successful job acted on everything
// up to (the last_seq of its read that reached the end of the feed; see Recorder.Wrap). The
// producer's reconciliation sweep (every SPIEGEL_SWEEP_INTERVAL, the first right after start)
// reads the update_seq of every matched db from CouchDB and enqueues each (group, db) whose
// record is missing or does not cover it. Whatever NATS lost, CouchDB still says the db has
// moved past the record, so the db gets a job within one sweep interval.
//
// Seqs are opaque: a record covers an update_seq when the two are the same string. CouchDB 2+
// sends one state as different strings (a db's update_seq lists its shards in another order
// than a _changes last_seq; a cluster answers from other copies), so a record of another string
// is due here, and the sweep then asks CouchDB whether the db changed after the record (one
// _changes row, couch.Client.ChangedSince; the producer remembers the answer per record and
// update_seq). A wrong "due" costs a job, never a change.
//
// Costs: no CouchDB request of its own (the record is the end of the handler's own feed read),
// one key-value put per successful job; per sweep, one read of the whole bucket (an ordered
// consumer) beside the snapshot of the dbs' update_seqs. A busy db gets at most one extra,
// deduplicated, job per sweep. A lost bucket costs one job per matched db, once.
package reconcile

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

// ErrNoBucket means the bucket of completion records does not exist (any more).
var ErrNoBucket = errors.New("the bucket of completion records is missing")

// Records reads and writes the completion records of one installation's bucket. It is safe for
// concurrent use.
type Records struct {
	kv jetstream.KeyValue
	js jetstream.JetStream
}

// New returns the records of kv (natsjs.DoneBucket); js purges a deleted db's records (DropDB).
func New(js jetstream.JetStream, kv jetstream.KeyValue) *Records {
	return &Records{kv: kv, js: js}
}

// Key is the key of the record of (g, db): the group, a dot, the db name base64url-encoded, so
// that any db name makes a valid key and a db's records of every group share one subject
// pattern.
func Key(g events.Group, db string) string {
	return string(g) + "." + base64.RawURLEncoding.EncodeToString([]byte(db))
}

// ParseKey reverses Key.
func ParseKey(key string) (events.Group, string, error) {
	g, enc, ok := strings.Cut(key, ".")
	if !ok || g == "" || strings.Contains(enc, ".") {
		return "", "", fmt.Errorf("completion record key %q: want <group>.<base64url db name>", key)
	}
	db, err := base64.RawURLEncoding.Strict().DecodeString(enc)
	if err != nil {
		return "", "", fmt.Errorf("completion record key %q: db name: %w", key, err)
	}
	return events.Group(g), string(db), nil
}

// Put records that a job of g processed db up to seq (see PutFor), vouching for no rule set.
func (r *Records) Put(ctx context.Context, g events.Group, db, seq string) error {
	return r.PutFor(ctx, g, db, seq, "")
}

// PutFor records that a job of g processed db up to seq, the last_seq of a read of the db's
// feed that reached its end, with the rules whose fingerprint is rules (rules.Set.Fingerprint:
// the group's enabled rules that match db, with their revisions). A holder that ran late (its
// lease lost after the check, a put that overtakes a newer one) may write an older seq over a
// newer: that costs one job more at the next sweep, never a change, because the sweep only
// skips a db whose record covers CouchDB's update_seq.
func (r *Records) PutFor(ctx context.Context, g events.Group, db, seq, rules string) error {
	if _, err := r.kv.Put(ctx, Key(g, db), []byte(Value(seq, rules))); err != nil {
		return fmt.Errorf("record %s done for %s: %w", g, db, err)
	}
	return nil
}

// Value is a record's value: seq, and, when known, a newline and the fingerprint of the rules
// the job ran with. A record's rules say which rules it vouches for: a rule added or edited since
// (another fingerprint) leaves the db due, so that the rule acts on the db's existing docs even
// when its own catch-up job was lost (SPEC §7.9).
func Value(seq, rules string) string {
	if rules == "" {
		return seq
	}
	return seq + "\n" + rules
}

// ParseValue splits a record's value into its seq and its rules' fingerprint ("" when the
// record names none, as an earlier release's).
func ParseValue(v string) (seq, rules string) {
	seq, rules, _ = strings.Cut(v, "\n")
	return seq, rules
}

// Get returns the record of (g, db), "" when there is none.
func (r *Records) Get(ctx context.Context, g events.Group, db string) (string, error) {
	e, err := r.kv.Get(ctx, Key(g, db))
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return "", nil
	case err != nil:
		return "", fmt.Errorf("read the completion record of %s for %s: %w", g, db, err)
	}
	return string(e.Value()), nil
}

// Done is the records read at one moment, by key (Key).
type Done map[string]string

// Due returns those of groups whose record of db is missing or does not cover seq (Covered):
// the groups that may have to run db (see the package doc: the sweep asks CouchDB about a
// record of another string before it enqueues). With rules (nil: not compared), a record that
// vouches for other rules than rules(g) is due as well (RulesChanged).
func (d Done) Due(db, seq string, groups []events.Group, rules func(events.Group) string) []events.Group {
	var due []events.Group
	for _, g := range groups {
		done, ok := d[Key(g, db)]
		if !ok || !Covered(done, seq) || rules != nil && RulesChanged(done, rules(g)) {
			due = append(due, g)
		}
	}
	return due
}

// Covered reports whether a record says, by itself, that its group is done with a db now at
// update_seq seq: its seq is the same string. A record of another string may still be done with
// the db (one state sent as another string): only CouchDB can tell (couch.Client.ChangedSince).
func Covered(record, seq string) bool {
	rseq, _ := ParseValue(record)
	return rseq != "" && rseq == seq
}

// RulesChanged reports whether record vouches for other rules than those of fingerprint rules:
// a rule added, edited or removed since. A record that names none (an earlier release's)
// vouches for whatever rules there are.
func RulesChanged(record, rules string) bool {
	_, rr := ParseValue(record)
	return rr != "" && rr != rules
}

// Read reads every record, with one ephemeral consumer over the bucket (natsjs.LastPerSubject),
// and never a cached copy: a watch kept between sweeps would not see a store rolled back or
// purged (no delete markers), and would go on claiming dbs done that NATS no longer says are.
// Unlike a KV watch, it does not stop at a pending count of 0 that a clustered server sends
// early, which would leave records out and make the sweep enqueue their dbs for nothing. A
// missing bucket is ErrNoBucket.
func (r *Records) Read(ctx context.Context) (Done, error) {
	s, err := r.js.Stream(ctx, "KV_"+r.kv.Bucket())
	var last map[string]natsjs.LastMsg
	if err == nil {
		last, err = natsjs.LastPerSubject(ctx, s, "", false, readIdle)
	}
	switch {
	case missing(err):
		return nil, fmt.Errorf("read completion records: %w", ErrNoBucket)
	case err != nil:
		return nil, fmt.Errorf("read completion records: %w", err)
	}
	subject := keySubjects(s)
	done := make(Done, len(last))
	for subj, m := range last {
		if natsjs.KVDeleted(m.Header) {
			continue
		}
		done[strings.TrimPrefix(subj, subject)] = string(m.Data)
	}
	return done, nil
}

// readIdle bounds the wait for the next record while Read reads them (a bucket purged during
// the read ends it so, and the next sweep reads again).
const readIdle = 5 * time.Second

// missing reports whether err says the bucket's stream does not exist. The watch of a bucket
// whose stream is gone reports it with nats.go's own error value.
func missing(err error) bool {
	return errors.Is(err, jetstream.ErrBucketNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) ||
		errors.Is(err, nats.ErrStreamNotFound) || errors.Is(err, nats.ErrBucketNotFound)
}

// DropDB purges the records of db for every group with one request, for a deleted db: a db
// recreated later must not find a record of its predecessor (PouchDB Server's integer seqs
// would make them equal). Unlike a key-value delete, a purge of the subjects leaves nothing
// behind, whatever the number of dbs deleted over time. Nobody watches the bucket.
func (r *Records) DropDB(ctx context.Context, db string) error {
	s, err := r.js.Stream(ctx, "KV_"+r.kv.Bucket())
	if err != nil {
		return fmt.Errorf("drop the completion records of %s: %w", db, err)
	}
	_, enc, _ := strings.Cut(Key("", db), ".")
	if err := s.Purge(ctx, jetstream.WithPurgeSubject(keySubjects(s)+"*."+enc)); err != nil {
		return fmt.Errorf("drop the completion records of %s: %w", db, err)
	}
	return nil
}

// keySubjects returns the prefix of the key subjects of the bucket of stream s: "$KV.<bucket>.",
// or the stream's own (a bucket in another domain, say).
func keySubjects(s jetstream.Stream) string {
	if subs := s.CachedInfo().Config.Subjects; len(subs) == 1 && strings.HasSuffix(subs[0], ".>") {
		return strings.TrimSuffix(subs[0], ">")
	}
	return "$KV." + strings.TrimPrefix(s.CachedInfo().Config.Name, "KV_") + "."
}
