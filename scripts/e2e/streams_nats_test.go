package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// streamsNATS is one topology of the benchmark: one nats-server (r1) or a three-node JetStream
// cluster (r3), in this process, with file storage; shut down when the (sub-)benchmark ends.
type streamsNATS struct {
	replicas int
	url      string // every server's client URL, comma-separated
	nc       *nats.Conn
	js       jetstream.JetStream
}

func startStreamsNATS(b *testing.B, topology string) *streamsNATS {
	b.Helper()
	var servers []*natstest.Server
	n := &streamsNATS{replicas: 1}
	switch topology {
	case "r1":
		servers = []*natstest.Server{natstest.Start(b)}
	case "r3":
		servers = natstest.StartCluster(b, 3)
		n.replicas = 3
	default:
		b.Fatalf("topology %q: want r1 or r3", topology)
	}
	urls := make([]string, len(servers))
	for i, s := range servers {
		urls[i] = s.URL()
	}
	n.url = strings.Join(urls, ",")
	nc, err := nats.Connect(n.url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		b.Fatalf("connect to %s: %v", n.url, err)
	}
	b.Cleanup(nc.Close)
	n.nc = nc
	if n.js, err = jetstream.New(nc); err != nil {
		b.Fatalf("jetstream: %v", err)
	}
	return n
}

// streamsStreamConfig is the config of the loop's and the subject rule's streams: file storage,
// the topology's replicas, a 24 h duplicate window and atomic publishes allowed, as install's
// SPIEGEL_CHANGES (a subject rule publishes a page as one atomic batch on a replicated stream
// that allows them).
func (n *streamsNATS) streamConfig(name, subjects string) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:               name,
		Subjects:           []string{subjects},
		Retention:          jetstream.LimitsPolicy,
		Storage:            jetstream.FileStorage,
		Replicas:           n.replicas,
		Duplicates:         24 * time.Hour,
		AllowAtomicPublish: true,
	}
}

// retry calls f until it succeeds or 30 s have passed: a cluster that has just elected its
// meta leader may not place a replicated stream at once.
func retry(b *testing.B, what string, f func(ctx context.Context) error) {
	b.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := f(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s: %v", what, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (n *streamsNATS) createStream(b *testing.B, cfg jetstream.StreamConfig) {
	b.Helper()
	retry(b, fmt.Sprintf("create stream %s (%d replicas)", cfg.Name, cfg.Replicas), func(ctx context.Context) error {
		_, err := n.js.CreateStream(ctx, cfg)
		return err
	})
}

// createBucket creates a mirror's bucket as onchange would (history 1, the topology's replicas,
// file storage), with atomic publishes allowed as the streams are (a mirror rule writes a page
// of a replicated bucket as atomic batches when the bucket allows them), so that the rule uses
// it as it is.
func (n *streamsNATS) createBucket(b *testing.B, name string) {
	b.Helper()
	retry(b, fmt.Sprintf("create bucket %s (%d replicas)", name, n.replicas), func(ctx context.Context) error {
		_, err := n.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: name, History: 1, Replicas: n.replicas, Storage: jetstream.FileStorage})
		if err != nil {
			return err
		}
		st, err := n.js.Stream(ctx, "KV_"+name)
		if err != nil {
			return err
		}
		cfg := st.CachedInfo().Config
		cfg.AllowAtomicPublish = true
		_, err = n.js.UpdateStream(ctx, cfg)
		return err
	})
}

// deleteStream deletes a stream the benchmark created (a bucket's is KV_<bucket>).
func (n *streamsNATS) deleteStream(b *testing.B, name string) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := n.js.DeleteStream(ctx, name); err != nil {
		b.Logf("delete stream %s: %v", name, err)
	}
}

// streamState returns the state of stream name, with the subjects matching filter when it is
// not empty.
func (n *streamsNATS) streamState(name, filter string) (jetstream.StreamState, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := n.js.Stream(ctx, name)
	if err != nil {
		return jetstream.StreamState{}, err
	}
	var opts []jetstream.StreamInfoOpt
	if filter != "" {
		opts = append(opts, jetstream.WithSubjectFilter(filter))
	}
	info, err := s.Info(ctx, opts...)
	if err != nil {
		return jetstream.StreamState{}, err
	}
	return info.State, nil
}

// streamMsgs returns the messages stream name holds.
func (n *streamsNATS) streamMsgs(name string) (int, error) {
	st, err := n.streamState(name, "")
	return int(st.Msgs), err
}

// bucketDocKeys returns the keys of bucket that are docs': every key (a subject of the bucket's
// stream) but the fence keys the mirror keeps, one per db it has begun (mirrorkey.FencePrefix).
func (n *streamsNATS) bucketDocKeys(bucket string) (int, error) {
	st, err := n.streamState("KV_"+bucket, "")
	if err != nil {
		return 0, err
	}
	fences, err := n.streamState("KV_"+bucket, "$KV."+bucket+"."+mirrorkey.FencePrefix+">")
	if err != nil {
		return 0, err
	}
	return int(st.NumSubjects) - len(fences.Subjects), nil
}

// bucketKeysOf returns the keys bucket holds for db's docs (mirrorkey.DBPrefix), counted by an
// ephemeral consumer that delivers the last message of each of them.
func (n *streamsNATS) bucketKeysOf(bucket, db string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := n.js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		return 0, err
	}
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{
		FilterSubject:     "$KV." + bucket + "." + mirrorkey.DBPrefix(db),
		DeliverPolicy:     jetstream.DeliverLastPerSubjectPolicy,
		AckPolicy:         jetstream.AckNonePolicy,
		HeadersOnly:       true,
		InactiveThreshold: time.Minute,
		MemoryStorage:     true,
	})
	if err != nil {
		return 0, err
	}
	defer func() { _ = s.DeleteConsumer(ctx, c.CachedInfo().Name) }()
	return int(c.CachedInfo().NumPending), nil
}

// natsServerVersion is the version of the nats-server module the benchmark runs.
func natsServerVersion() string { return server.VERSION }

// natsSyncSetting describes the servers' storage sync (natstest.SyncEnv).
func natsSyncSetting() string {
	if v := os.Getenv(natstest.SyncEnv); v != "" {
		return "sync " + v + " (" + natstest.SyncEnv + ")"
	}
	return "sync_interval the server's default (2 min)"
}
