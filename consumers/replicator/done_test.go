package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
)

// A successful job records its db done at a position that covers the db's update_seq (the record
// the producer's reconciliation sweep compares with CouchDB: the native engine's end of the feed,
// or the update_seq read before a _replicate), with either engine; a later write leaves the
// record behind until the next job.
func TestJobRecordsDone(t *testing.T) {
	t.Parallel()
	for _, engine := range []string{"couchdb", "native"} {
		t.Run(engine, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 10*time.Second)
			cfg := e.cfg
			cfg.Engine = engine
			src, dst := e.Prefix+"src", e.Prefix+"dst"
			e.Couch.CreateDB(t, src)
			e.Couch.CreateDB(t, dst)
			e.Couch.Put(t, src, "a", map[string]any{"x": 1})
			p := e.startReplicator(t, &cfg)
			e.Couch.Put(t, e.cfg.DBName, "rep", map[string]any{"type": "replicator", "source": src, "target": dst})
			p.waitRule(t, src)

			kv, err := natsjs.DoneBucket(t.Context(), e.JS, natsjs.DefaultTopology(""))
			require.NoError(t, err)
			records := reconcile.New(e.JS, kv)
			cc, err := couch.New(couch.Config{URL: e.Couch.URL}, nil)
			require.NoError(t, err)
			recorded := func() string {
				done, err := records.Read(t.Context())
				require.NoError(t, err)
				return done[reconcile.Key(events.GroupReplicate, src)]
			}
			seq := func() string {
				info, err := cc.DBInfo(t.Context(), src)
				require.NoError(t, err)
				return info.UpdateSeq
			}
			// covers: the record covers the db as the sweep asks it: the same string, or no
			// change in CouchDB after the record's seq (CouchDB 3 sends one state as several
			// strings).
			covers := func(record string) bool {
				if record == "" || reconcile.Covered(record, seq()) {
					return record != ""
				}
				rseq, _ := reconcile.ParseValue(record)
				changed, err := cc.ChangedSince(t.Context(), src, rseq)
				return err == nil && !changed
			}

			e.publish(t, src)
			waitConverged(t, e.Couch, src, dst, 20*time.Second)
			require.Eventually(t, func() bool { return covers(recorded()) }, 20*time.Second, 20*time.Millisecond,
				"the job never recorded the db done at its update_seq")

			e.Couch.Put(t, src, "b", map[string]any{"x": 2})
			assert.False(t, covers(recorded()), "a write after the job: the record is behind")
			e.publish(t, src)
			require.Eventually(t, func() bool { return covers(recorded()) }, 20*time.Second, 20*time.Millisecond,
				"the next job never recorded the new update_seq")
		})
	}
}
