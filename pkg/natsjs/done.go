package natsjs

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// DoneBucketConfig is the bucket of completion records (package reconcile): one value per
// (group, db), the position of the db's feed that the group's last successful job acted on
// everything up to. It is
// an accelerator like every NATS state of the service: losing it costs one job per matched db,
// never a change (the producer's sweep enqueues every db whose record is missing).
func (t Topology) DoneBucketConfig() jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{
		Bucket:      t.Subjects.DoneBucket(),
		Description: "Spiegel: per (group, db), the update_seq its last successful job started from (the sweep compares it with CouchDB)",
		History:     1,
		Storage:     jetstream.FileStorage,
		Replicas:    t.replicas(),
	}
}

// EnsureDoneBucket creates the bucket of completion records unless it exists; an existing one
// is left as it is, whatever its settings (it never updates one). Ensure creates it with the
// rest; the producer's sweep calls it when the bucket is gone, so that a lost bucket heals
// itself.
func EnsureDoneBucket(ctx context.Context, js jetstream.JetStream, t Topology) error {
	_, err := Object{Kind: KindBucket, Bucket: t.DoneBucketConfig()}.Create(ctx, js)
	return err
}

// DoneBucket opens the bucket of completion records; a missing bucket is an error wrapping
// ErrNotInstalled (an installation made by an older release lacks it: running install again
// adds it).
func DoneBucket(ctx context.Context, js jetstream.JetStream, t Topology) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, t.Subjects.DoneBucket())
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("key-value bucket %s is missing: %w", t.Subjects.DoneBucket(), ErrNotInstalled)
	}
	if err != nil {
		return nil, fmt.Errorf("open key-value bucket %s: %w", t.Subjects.DoneBucket(), err)
	}
	return kv, nil
}
