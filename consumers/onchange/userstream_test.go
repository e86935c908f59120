package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// TestUserStreamsAreNotHealed: a rule's subject may be captured by a stream its users own, whose settings make messages go
// away for reasons of their own: consumed (WorkQueue retention), limited per subject, purged.
// The rule must make progress, delete nothing and publish nothing it already published: what is
// gone from a stream we did not create is its owner's business. Before, a job took the messages
// a reader had consumed for a loss and published the db's history again (38 messages for 20
// changes), and a hole heal deleted messages readers had read; with DenyDelete it failed for
// ever.
func TestUserStreamsAreNotHealed(t *testing.T) {
	cases := []struct {
		name string
		cfg  jetstream.StreamConfig
		// between runs after each round of writes (the stream's owner at work).
		between func(t *testing.T, e *env, st jetstream.Stream, subject string)
	}{
		{name: "work queue consumed by a reader", cfg: jetstream.StreamConfig{Retention: jetstream.WorkQueuePolicy},
			between: consumeAll},
		{name: "max messages per subject", cfg: jetstream.StreamConfig{MaxMsgsPerSubject: 2}},
		{name: "purged by subject",
			between: func(t *testing.T, _ *env, st jetstream.Stream, subject string) {
				require.NoError(t, st.Purge(t.Context(), jetstream.WithPurgeSubject(subject)))
			}},
		{name: "deny delete and purge", cfg: jetstream.StreamConfig{DenyDelete: true, DenyPurge: true}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, 60*time.Second)
			app := e.start(t)
			cfg := c.cfg
			cfg.Name = fmt.Sprintf("TEAM%d", i)
			// A short duplicate window, which the rounds outlast (as an owner's 2 s window and
			// writes minutes apart): a change published again is stored again.
			cfg.Duplicates = 100 * time.Millisecond
			prefix := fmt.Sprintf("team%d.changes", i)
			cfg.Subjects = []string{prefix + ".>"}
			st, err := e.JS.CreateStream(t.Context(), cfg)
			require.NoError(t, err)
			db := e.Couch.NewOneShardDB(t, e.Prefix)
			e.ruleIn(t, app, "pub", db, map[string]any{"subject": prefix + ".${db_name}"})
			subject := prefix + "." + events.EncodeDBName(db)
			// Another db's message on the stream, waiting: the stream's first message is older.
			_, err = e.JS.Publish(t.Context(), prefix+".another", []byte(`{}`))
			require.NoError(t, err)

			for round := range 4 {
				for n := range 5 {
					e.Couch.Put(t, db, fmt.Sprintf("r%dd%d", round, n), map[string]any{"v": n})
				}
				e.enqueue(t, db)
				want := uint64(1 + 5*(round+1))
				require.Eventually(t, func() bool {
					info, err := st.Info(t.Context())
					return err == nil && info.State.LastSeq >= want && e.caughtUp(t, "pub", db)
				}, 30*time.Second, 20*time.Millisecond, "round %d published", round)
				if c.between != nil {
					c.between(t, e, st, subject)
				}
				windowEnd := time.Now().Add(cfg.Duplicates)
				require.Eventually(t, func() bool { return time.Now().After(windowEnd) }, time.Second, 10*time.Millisecond, "the duplicate window passes")
			}
			info, err := st.Info(t.Context())
			require.NoError(t, err)
			assert.Equal(t, uint64(21), info.State.LastSeq, "20 changes published once each, nothing again")
			if cfg.DenyDelete {
				assert.Zero(t, info.State.NumDeleted, "nothing deleted")
			}
			assert.Zero(t, gapsCounted(app, gapSubject), "a stream we did not create is not judged")
		})
	}
}

// consumeAll is a reader of a work-queue stream: it takes and acknowledges every message on
// subject, which the stream then removes.
func consumeAll(t *testing.T, e *env, st jetstream.Stream, subject string) {
	t.Helper()
	cons, err := st.CreateOrUpdateConsumer(t.Context(), jetstream.ConsumerConfig{Durable: "reader", FilterSubject: subject, AckPolicy: jetstream.AckExplicitPolicy})
	require.NoError(t, err)
	for {
		batch, err := cons.FetchNoWait(100)
		require.NoError(t, err)
		n := 0
		for m := range batch.Messages() {
			require.NoError(t, m.DoubleAck(t.Context()))
			n++
		}
		require.NoError(t, batch.Error())
		if n == 0 {
			return
		}
	}
}
