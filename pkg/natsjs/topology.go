package natsjs

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// ErrNotInstalled means the streams or consumers the service needs do not exist yet.
var ErrNotInstalled = errors.New("spiegel is not installed: run `producer install` first")

// Topology is the JetStream layout of SPEC §3, derived from the subject prefix.
type Topology struct {
	Subjects events.Subjects
	// Replicas of every stream: 1 on a single server, 3 on a cluster.
	Replicas int
	// AckWait of the work consumers; a job whose consumer died is redelivered after it.
	AckWait time.Duration
	// MaxAckPending bounds the jobs delivered and not yet acknowledged, per consumer.
	MaxAckPending int
	// ChangesMaxAge bounds how long published changes are kept (0 = forever).
	ChangesMaxAge time.Duration
	// DeadLetterMaxAge bounds how long dead-letter records are kept (0 = forever).
	DeadLetterMaxAge time.Duration
}

// DefaultTopology returns the defaults for prefix.
func DefaultTopology(prefix string) Topology {
	return Topology{
		Subjects:         events.NewSubjects(prefix),
		Replicas:         1,
		AckWait:          60 * time.Second,
		MaxAckPending:    1000,
		ChangesMaxAge:    7 * 24 * time.Hour,
		DeadLetterMaxAge: 30 * 24 * time.Hour,
	}
}

func (t Topology) replicas() int {
	if t.Replicas < 1 {
		return 1
	}
	return t.Replicas
}

// WorkStreamConfig is the work queue: one pending message per subject, further publishes to a
// subject that holds one are rejected (the dedup of SPEC §3).
func (t Topology) WorkStreamConfig() jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:                 t.Subjects.WorkStream(),
		Description:          "Spiegel jobs: one pending message per (group, db) that has unprocessed changes",
		Subjects:             []string{t.Subjects.WorkAll()},
		Retention:            jetstream.WorkQueuePolicy,
		Storage:              jetstream.FileStorage,
		Discard:              jetstream.DiscardNew,
		DiscardNewPerSubject: true,
		MaxMsgsPerSubject:    1,
		MaxMsgs:              -1,
		MaxBytes:             -1,
		Replicas:             t.replicas(),
		Duplicates:           0,
	}
}

// WakeupStreamConfig keeps one marker per (group, db): "a change came while this db's job was
// pending or running" (see Jobs.Offer). A new marker replaces the old one.
func (t Topology) WakeupStreamConfig() jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:              t.Subjects.WakeupStream(),
		Description:       "Spiegel wakeup markers: a change arrived while its db's job was pending or running",
		Subjects:          []string{t.Subjects.WakeupAll()},
		Retention:         jetstream.LimitsPolicy,
		Storage:           jetstream.FileStorage,
		Discard:           jetstream.DiscardOld,
		MaxMsgsPerSubject: 1,
		Replicas:          t.replicas(),
	}
}

// LeaseStreamConfig holds the lease of every running job: one message per (group, db)
// (Subjects.Lease), stored with an expected last sequence on its subject and a time to live of
// AckWait, so that at most one instance holds a db's job, through consumer leader changes too
// (worker's claim). A holder that dies leaves a message that expires.
func (t Topology) LeaseStreamConfig() jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:              t.Subjects.LeaseStream(),
		Description:       "Spiegel job leases: the instance running each (group, db)'s job",
		Subjects:          []string{t.Subjects.LeaseAll()},
		Retention:         jetstream.LimitsPolicy,
		Storage:           jetstream.FileStorage,
		Discard:           jetstream.DiscardOld,
		MaxMsgsPerSubject: 1,
		AllowMsgTTL:       true,
		Replicas:          t.replicas(),
	}
}

// OnChangeBucketConfig is the cache of on_change checkpoints (their home is a _local doc in the
// watched db: see checkpoint.OnChangeStore). One value per (rule, db).
func (t Topology) OnChangeBucketConfig() jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{
		Bucket:      t.Subjects.OnChangeBucket(),
		Description: "Spiegel: cache of the checkpoints of on_change rules (the _local docs in the watched dbs hold them)",
		History:     1,
		Storage:     jetstream.FileStorage,
		Replicas:    t.replicas(),
	}
}

// DeadLetterStreamConfig keeps records of requests and replications given up.
func (t Topology) DeadLetterStreamConfig() jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        t.Subjects.DeadLetterStream(),
		Description: "Spiegel dead letters: requests and replications given up after their retry limit",
		Subjects:    []string{t.Subjects.DeadLetterAll()},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		MaxAge:      t.DeadLetterMaxAge,
		Replicas:    t.replicas(),
	}
}

// ChangesStreamConfig captures the changes `subject` rules publish; message ids deduplicate
// re-dispatches within the duplicate window. Atomic batch publishes are allowed: on a replicated
// stream a rule publishes a page as one batch, which the stream stores whole or not at all.
//
// The duplicate window is 24 hours, or the stream's MaxAge when that is shorter (JetStream
// refuses a window longer than the age).
func (t Topology) ChangesStreamConfig() jetstream.StreamConfig {
	dups := 24 * time.Hour
	if t.ChangesMaxAge > 0 && t.ChangesMaxAge < dups {
		dups = t.ChangesMaxAge
	}
	return jetstream.StreamConfig{
		Name:        t.Subjects.ChangesStream(),
		Description: "Spiegel changes published by on_change rules with a subject",
		Subjects:    []string{t.Subjects.ChangesAll()},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		MaxAge:      t.ChangesMaxAge,
		Duplicates:  dups,
		Replicas:    t.replicas(),

		AllowAtomicPublish: true,
	}
}

// ConsumerConfig is the durable pull consumer of group g. MaxDeliver is unlimited: the worker
// decides when a job is given up (Term plus a dead letter), because in a work queue a message
// that ran out of deliveries would hold its db's subject forever.
func (t Topology) ConsumerConfig(g events.Group) jetstream.ConsumerConfig {
	ackWait := t.AckWait
	if ackWait <= 0 {
		ackWait = 60 * time.Second
	}
	maxAck := t.MaxAckPending
	if maxAck <= 0 {
		maxAck = 1000
	}
	return jetstream.ConsumerConfig{
		Durable:       g.ConsumerName(),
		Description:   fmt.Sprintf("Spiegel %s workers", g),
		FilterSubject: t.Subjects.WorkGroup(g),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1,
		MaxAckPending: maxAck,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		Replicas:      t.replicas(),
	}
}

// Ensure creates every stream, key-value bucket and consumer of t that is missing and leaves
// those that exist as they are, whatever their settings (SPEC §3 "Hands off what we did not
// create": an operator's `nats stream edit` survives; `producer install` reports how they differ
// from t and applies that only when asked). It is idempotent and safe to run from several
// processes at once.
func Ensure(ctx context.Context, js jetstream.JetStream, t Topology) error {
	for _, o := range t.Objects() {
		if _, err := o.Create(ctx, js); err != nil {
			return err
		}
	}
	return nil
}

// ObjectKind tells a stream, a key-value bucket and a consumer apart.
type ObjectKind int

// The kinds of Object.
const (
	KindStream ObjectKind = iota
	KindBucket
	KindConsumer
)

// Object is one stream, key-value bucket or consumer of a topology, with the configuration it is
// created with: Stream for a stream, Bucket for a bucket, Consumer (on the stream named
// ConsumerStream) for a consumer.
type Object struct {
	Kind           ObjectKind
	Stream         jetstream.StreamConfig
	Bucket         jetstream.KeyValueConfig
	Consumer       jetstream.ConsumerConfig
	ConsumerStream string
}

// Objects lists what t is made of, in the order it is created: the streams, the buckets, then the
// consumers of the work stream.
func (t Topology) Objects() []Object {
	var out []Object
	for _, cfg := range []jetstream.StreamConfig{t.WorkStreamConfig(), t.WakeupStreamConfig(), t.LeaseStreamConfig(), t.DeadLetterStreamConfig(), t.ChangesStreamConfig()} {
		out = append(out, Object{Kind: KindStream, Stream: cfg})
	}
	for _, cfg := range []jetstream.KeyValueConfig{t.OnChangeBucketConfig(), t.DoneBucketConfig()} {
		out = append(out, Object{Kind: KindBucket, Bucket: cfg})
	}
	for _, g := range events.Groups {
		out = append(out, Object{Kind: KindConsumer, Consumer: t.ConsumerConfig(g), ConsumerStream: t.Subjects.WorkStream()})
	}
	return out
}

// String names o for a person: "stream SPIEGEL_WORK", "key-value bucket spiegel_onchange",
// "consumer replicator of stream SPIEGEL_WORK".
func (o Object) String() string {
	switch o.Kind {
	case KindStream:
		return "stream " + o.Stream.Name
	case KindBucket:
		return "key-value bucket " + o.Bucket.Bucket
	default:
		return "consumer " + o.Consumer.Durable + " of stream " + o.ConsumerStream
	}
}

// StreamName is the stream that holds o: its own name, its bucket's KV_ stream, the stream its
// consumer reads.
func (o Object) StreamName() string {
	switch o.Kind {
	case KindStream:
		return o.Stream.Name
	case KindBucket:
		return "KV_" + o.Bucket.Bucket
	default:
		return o.ConsumerStream
	}
}

// Create creates o unless it exists, and reports whether it did. An existing one is left exactly
// as it is; one that a concurrent install creates meanwhile counts as existing. A bucket it
// creates reads at its stream's leader (see readAtLeader).
func (o Object) Create(ctx context.Context, js jetstream.JetStream) (created bool, err error) {
	for attempt := 0; attempt < 5; attempt++ {
		exists, err := o.exists(ctx, js)
		if err != nil || exists {
			return false, err
		}
		switch o.Kind {
		case KindStream:
			_, err = js.CreateStream(ctx, o.Stream)
		case KindBucket:
			if _, err = js.CreateKeyValue(ctx, o.Bucket); err == nil {
				err = readAtLeader(ctx, js, o.Bucket.Bucket)
			}
		default:
			_, err = js.CreateConsumer(ctx, o.ConsumerStream, o.Consumer)
		}
		if err == nil {
			return true, nil
		}
		if !isRace(err) && !errors.Is(err, jetstream.ErrBucketExists) {
			return false, fmt.Errorf("create %s: %w", o, err)
		}
		// Created by a concurrent install since the look-up: look again.
	}
	return false, fmt.Errorf("create %s: it kept appearing and disappearing", o)
}

// exists looks o up.
func (o Object) exists(ctx context.Context, js jetstream.JetStream) (bool, error) {
	var err error
	switch o.Kind {
	case KindStream:
		_, err = js.Stream(ctx, o.Stream.Name)
	case KindBucket:
		_, err = js.KeyValue(ctx, o.Bucket.Bucket)
	default:
		_, err = js.Consumer(ctx, o.ConsumerStream, o.Consumer.Durable)
	}
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, jetstream.ErrStreamNotFound), errors.Is(err, jetstream.ErrBucketNotFound),
		errors.Is(err, jetstream.ErrConsumerNotFound):
		return false, nil
	}
	return false, fmt.Errorf("look up %s: %w", o, err)
}

// readAtLeader makes the reads of a key-value bucket go to its stream's leader: the bucket's
// stream allows no direct gets. A direct get may be answered by any replica, one that lags behind
// the leader or, after NATS lost acknowledged writes, one that came back with another history;
// the values of these buckets are written with a compare-and-set on the revision read (a
// checkpoint's fence, a record's update), which such a read makes fail at the leader again and
// again. A read at the leader costs the same one request. Create calls it on a bucket it just
// created; an existing bucket is left as it is.
func readAtLeader(ctx context.Context, js jetstream.JetStream, bucket string) error {
	st, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		return fmt.Errorf("read the stream of key-value bucket %s: %w", bucket, err)
	}
	if scfg := st.CachedInfo().Config; scfg.AllowDirect {
		scfg.AllowDirect = false
		if _, err := js.UpdateStream(ctx, scfg); err != nil {
			return fmt.Errorf("make key-value bucket %s read at its leader: %w", bucket, err)
		}
	}
	return nil
}

// OnChangeBucket opens the cache of on_change checkpoints; a missing bucket is an error wrapping
// ErrNotInstalled.
func OnChangeBucket(ctx context.Context, js jetstream.JetStream, t Topology) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, t.Subjects.OnChangeBucket())
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("key-value bucket %s is missing: %w", t.Subjects.OnChangeBucket(), ErrNotInstalled)
	}
	if err != nil {
		return nil, fmt.Errorf("open key-value bucket %s: %w", t.Subjects.OnChangeBucket(), err)
	}
	return kv, nil
}

// isRace reports errors that a concurrent install can cause and a retry resolves.
func isRace(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case jetstream.JSErrCodeStreamNameInUse, jetstream.JSErrCodeStreamNotFound,
			jetstream.JSErrCodeConsumerAlreadyExists, jetstream.JSErrCodeConsumerExists,
			jetstream.JSErrCodeConsumerNameExists, jetstream.JSErrCodeConsumerDoesNotExist:
			return true
		}
	}
	return errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || errors.Is(err, jetstream.ErrStreamNotFound) ||
		errors.Is(err, jetstream.ErrConsumerExists) || errors.Is(err, jetstream.ErrConsumerNotFound)
}

// CheckInstalled returns an error wrapping ErrNotInstalled when the work stream, the wakeup
// stream, or the consumer of one of groups, is missing (an installation made by an older
// release lacks the wakeup stream: running install again adds it).
func CheckInstalled(ctx context.Context, js jetstream.JetStream, t Topology, groups ...events.Group) error {
	for _, name := range []string{t.Subjects.WakeupStream(), t.Subjects.LeaseStream()} {
		if _, err := js.Stream(ctx, name); errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("stream %s is missing: %w", name, ErrNotInstalled)
		} else if err != nil {
			return fmt.Errorf("look up stream %s: %w", name, err)
		}
	}
	s, err := js.Stream(ctx, t.Subjects.WorkStream())
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("stream %s is missing: %w", t.Subjects.WorkStream(), ErrNotInstalled)
	}
	if err != nil {
		return fmt.Errorf("look up stream %s: %w", t.Subjects.WorkStream(), err)
	}
	for _, g := range groups {
		if _, err := s.Consumer(ctx, g.ConsumerName()); err != nil {
			if errors.Is(err, jetstream.ErrConsumerNotFound) {
				return fmt.Errorf("consumer %s is missing: %w", g.ConsumerName(), ErrNotInstalled)
			}
			return fmt.Errorf("look up consumer %s: %w", g.ConsumerName(), err)
		}
	}
	return nil
}

// Remove deletes the work, wakeup, lease and dead-letter streams (and so their consumers), the changes
// stream, the checkpoint cache and the completion records. Missing ones are not an error.
func Remove(ctx context.Context, js jetstream.JetStream, t Topology) error {
	for _, name := range []string{t.Subjects.WorkStream(), t.Subjects.WakeupStream(), t.Subjects.LeaseStream(), t.Subjects.DeadLetterStream(), t.Subjects.ChangesStream()} {
		if err := js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("delete stream %s: %w", name, err)
		}
	}
	for _, b := range []string{t.Subjects.OnChangeBucket(), t.Subjects.DoneBucket()} {
		if err := js.DeleteKeyValue(ctx, b); err != nil && !errors.Is(err, jetstream.ErrBucketNotFound) {
			return fmt.Errorf("delete key-value bucket %s: %w", b, err)
		}
	}
	return nil
}

// installedRetry paces AwaitInstalled's attempts.
var installedRetry = backoff.Policy{Initial: 250 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2, Jitter: 0.2}

// AwaitInstalled runs check (a daemon's look-up of the installation at start: CheckInstalled,
// OnChangeBucket) until it succeeds or finds the installation missing (an error wrapping
// ErrNotInstalled), which it returns. Any other error is NATS not answering yet — a JetStream API
// request timing out or finding no responders while the cluster elects a meta or stream leader —
// and the daemons wait for NATS as long as it takes: the attempt is logged and retried until ctx
// ends, when the last error is returned.
func AwaitInstalled(ctx context.Context, log logrus.FieldLogger, check func(context.Context) error) error {
	for attempt := 1; ; attempt++ {
		err := check(ctx)
		if err == nil || errors.Is(err, ErrNotInstalled) || ctx.Err() != nil {
			return err
		}
		log.WithField("attempt", attempt).WithField("error", logging.RedactText(err.Error())).
			Warn("JetStream did not answer the installation check, retrying")
		if backoff.Sleep(ctx, installedRetry.Delay(attempt)) != nil {
			return err
		}
	}
}
