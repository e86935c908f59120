package checkpoint

import (
	"context"
	"encoding/base64"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// CacheDropper drops every cached on_change checkpoint of a db at once, for a deleted db whose
// _local docs went with it. Unlike a key-value delete or purge, which leaves a marker per key in
// the bucket for good, it purges the entries' subjects from the bucket's stream: nothing is left
// behind, whatever the number of dbs deleted over time. The bucket has no watchers to tell.
type CacheDropper struct {
	stream  jetstream.Stream
	subject string // the bucket's key subject prefix, "$KV.<bucket>."
}

// NewCacheDropper returns the dropper of kv's entries (one stream lookup).
func NewCacheDropper(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue) (*CacheDropper, error) {
	s, err := js.Stream(ctx, "KV_"+kv.Bucket())
	if err != nil {
		return nil, fmt.Errorf("open the stream of key-value bucket %s: %w", kv.Bucket(), err)
	}
	subject := "$KV." + kv.Bucket() + "."
	if subs := s.CachedInfo().Config.Subjects; len(subs) == 1 && strings.HasSuffix(subs[0], ".>") {
		subject = strings.TrimSuffix(subs[0], ">") // the stream's own key subjects
	}
	return &CacheDropper{stream: s, subject: subject}, nil
}

// DropDB drops the cached checkpoints of every rule in db, and the fencing tokens of its native
// replications, with two requests. The next Load of such a checkpoint reads CouchDB.
func (d *CacheDropper) DropDB(ctx context.Context, db string) error {
	// cacheKey is <rule>.<db>, each encoded without dots: one wildcard for the rule. An earlier
	// release's token key "replication/<id>.<db>" matches it too.
	tok := token(db)
	for _, subj := range []string{d.subject + "*." + tok, d.subject + replicationPrefix + ".*.*." + tok} {
		if err := d.stream.Purge(ctx, jetstream.WithPurgeSubject(subj)); err != nil {
			return fmt.Errorf("drop the cached checkpoints of %s: %w", db, err)
		}
	}
	return nil
}

// DropRule drops everything rule keeps in the bucket, for every db: its cached on_change
// checkpoints and the fencing tokens of its native replications, with two requests, for a rule
// deleted or edited (an edit can change a replication's id, which would leave one dead token
// per db). A run of the rule that is under way then finds its entry gone: its next cache claim
// or token advance is refused, and the job runs again.
func (d *CacheDropper) DropRule(ctx context.Context, rule string) error {
	tok := token(rule)
	for _, subj := range []string{d.subject + tok + ".*", d.subject + replicationPrefix + "." + tok + ".*.*"} {
		if err := d.stream.Purge(ctx, jetstream.WithPurgeSubject(subj)); err != nil {
			return fmt.Errorf("drop what rule %s keeps in the bucket: %w", rule, err)
		}
	}
	return nil
}

// replicationPrefix starts the key of a native replication's fencing token (ReplicationKey).
// The on_change keys are two base64url tokens, never this word followed by a dot and three more.
const replicationPrefix = "replication"

// ReplicationKey is the key, in the on_change checkpoint bucket, of the fencing token of
// replication id run by rule for db: "replication.<rule>.<id>.<db>", rule and db base64url-
// encoded as in the on_change keys (cacheKey), id base64url-encoded too.
func ReplicationKey(rule, id, db string) string {
	return replicationPrefix + "." + token(rule) + "." + token(id) + "." + token(db)
}

// CacheKey is the key, in the on_change checkpoint bucket, of rule's cached checkpoint of db.
func CacheKey(rule, db string) string { return cacheKey(rule, db) }

// token encodes s as one key token (no dots), as cacheKey does; "" is "_", which no encoding of
// a non-empty string is (a NATS subject has no empty token).
func token(s string) string {
	if s == "" {
		return "_"
	}
	return base64.RawURLEncoding.EncodeToString([]byte(s))
}
