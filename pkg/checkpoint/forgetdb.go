package checkpoint

import (
	"context"
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

// DropDB drops the cached checkpoints of every rule in db with one request. The next Load of
// such a checkpoint reads CouchDB.
func (d *CacheDropper) DropDB(ctx context.Context, db string) error {
	// cacheKey is <rule>.<db>, each encoded without dots: one wildcard for the rule.
	_, dbToken, _ := strings.Cut(cacheKey("", db), ".")
	subj := d.subject + "*." + dbToken
	if err := d.stream.Purge(ctx, jetstream.WithPurgeSubject(subj)); err != nil {
		return fmt.Errorf("drop the cached checkpoints of %s: %w", db, err)
	}
	return nil
}
