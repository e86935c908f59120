package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

// A rule deleted leaves nothing in the checkpoint bucket: its cached on_change checkpoints of
// every db go (one purge, off the rule feed's path), and a replicator rule's native fencing
// tokens go when the rule is deleted or edited (an edit can change the replication id). An
// on_change rule edited keeps its entries: they stay its checkpoints. Before, both stayed, one
// key per matched db per edit, for good.
func TestRemovedRulesLeaveNoKeys(t *testing.T) {
	e := newEnv(t)
	hookRev := e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^u_", "url": "https://hooks.example.com/x"})
	repRev := e.putRule(t, "rep", map[string]any{"type": "replicator", "db_name": "^u_", "source": "$db_name", "target": "$db_name-copy", "engine": "native"})
	e.putRule(t, "kept", map[string]any{"type": "on_change", "db_name": "^u_", "url": "https://hooks.example.com/y"})
	kv, err := natsjs.OnChangeBucket(t.Context(), e.JS, natsjs.DefaultTopology(""))
	require.NoError(t, err)
	dbs := []string{"u_1", "u_2", "u_3"}
	for _, db := range dbs {
		for _, k := range []string{checkpoint.CacheKey("hook", db), checkpoint.CacheKey("kept", db), checkpoint.ReplicationKey("rep", "id1", db)} {
			_, err := kv.Put(t.Context(), k, []byte(`{}`))
			require.NoError(t, err)
		}
	}
	e.startProducer(t)
	e.waitRulesCaughtUp(t)
	has := func(k string) bool { _, err := kv.Get(t.Context(), k); return err == nil }

	hookRev = e.putRule(t, "hook", map[string]any{"_rev": hookRev, "type": "on_change", "db_name": "^u_", "url": "https://hooks.example.com/edited"})
	e.putRule(t, "rep", map[string]any{"_rev": repRev, "type": "replicator", "db_name": "^u_", "source": "$db_name", "target": "$db_name-other", "engine": "native"})
	require.Eventually(t, func() bool { return !has(checkpoint.ReplicationKey("rep", "id1", "u_1")) }, 20*time.Second, 20*time.Millisecond,
		"an edited replicator rule's tokens are dropped")
	assert.True(t, has(checkpoint.CacheKey("hook", "u_1")), "an edited on_change rule keeps its checkpoints")

	e.deleteDoc(t, e.cfg.DBName, "hook", hookRev)
	require.Eventually(t, func() bool {
		for _, db := range dbs {
			if has(checkpoint.CacheKey("hook", db)) {
				return false
			}
		}
		return true
	}, 20*time.Second, 20*time.Millisecond, "a deleted rule's cached checkpoints are dropped")
	for _, db := range dbs {
		assert.True(t, has(checkpoint.CacheKey("kept", db)), "another rule's entries stay")
	}
}
