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
