package checkpoint

import (
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// DropDB removes the cached checkpoints of every rule in one db with one request and leaves no
// marker behind (a key-value purge would leave one per key, for good); other dbs keep theirs.
func TestCacheDropperLeavesNothing(t *testing.T) {
	t.Parallel()
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	kv, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "T_ONCHANGE", History: 1})
	require.NoError(t, err)
	gone, kept := "user/1", "user_10" // a name with a byte the key encoding escapes
	for _, rule := range []string{"hook", "other", "a.b"} {
		for _, db := range []string{gone, kept} {
			_, err := kv.Put(t.Context(), cacheKey(rule, db), []byte(`{"last_seq":"5"}`))
			require.NoError(t, err)
		}
	}
	d, err := NewCacheDropper(t.Context(), js, kv)
	require.NoError(t, err)
	require.NoError(t, d.DropDB(t.Context(), gone))
	require.NoError(t, d.DropDB(t.Context(), "never_cached"))

	for _, rule := range []string{"hook", "other", "a.b"} {
		_, err := kv.Get(t.Context(), cacheKey(rule, gone))
		assert.ErrorIs(t, err, jetstream.ErrKeyNotFound, rule)
		_, err = kv.Get(t.Context(), cacheKey(rule, kept))
		assert.NoError(t, err, rule)
	}
	s, err := js.Stream(t.Context(), "KV_T_ONCHANGE")
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	assert.Equal(t, uint64(3), info.State.Msgs, "only the kept db's entries are left: no marker")
}

// DropRule removes everything one rule keeps in the bucket, for every db — its cached on_change
// checkpoints and its native replications' fencing tokens, of any replication id — and leaves
// no marker; other rules keep theirs. DropDB takes a db's tokens with its checkpoints, those of
// an earlier release's key form too.
func TestDropRuleLeavesNothing(t *testing.T) {
	t.Parallel()
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	kv, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "T_ONCHANGE", History: 1})
	require.NoError(t, err)
	put := func(keys ...string) {
		for _, k := range keys {
			_, err := kv.Put(t.Context(), k, []byte(`{}`))
			require.NoError(t, err)
		}
	}
	dbs := []string{"user/1", "user_2"}
	for _, db := range dbs {
		put(cacheKey("hook", db), cacheKey("other", db),
			ReplicationKey("rep", "id-before-edit", db), ReplicationKey("rep", "id-after-edit", db), ReplicationKey("rep2", "id", db))
	}
	legacy := "replication/oldid." + token("user/1")
	put(legacy)
	d, err := NewCacheDropper(t.Context(), js, kv)
	require.NoError(t, err)

	require.NoError(t, d.DropRule(t.Context(), "hook"))
	require.NoError(t, d.DropRule(t.Context(), "rep"))
	left := func() []string {
		keys, err := kv.ListKeys(t.Context())
		require.NoError(t, err)
		var out []string
		for k := range keys.Keys() {
			out = append(out, k)
		}
		return out
	}
	want := []string{legacy}
	for _, db := range dbs {
		want = append(want, cacheKey("other", db), ReplicationKey("rep2", "id", db))
	}
	assert.ElementsMatch(t, want, left(), "the removed rules leave nothing; the others keep everything")

	require.NoError(t, d.DropDB(t.Context(), "user/1"))
	assert.ElementsMatch(t, []string{cacheKey("other", "user_2"), ReplicationKey("rep2", "id", "user_2")}, left(),
		"a deleted db takes its tokens, the earlier key form's too")
	s, err := js.Stream(t.Context(), "KV_T_ONCHANGE")
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	assert.Equal(t, uint64(2), info.State.Msgs, "no marker left")
}
