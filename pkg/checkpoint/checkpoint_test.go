package checkpoint

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

func TestIDIsUnambiguous(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "spiegel_cp_hook_user_1", ID("hook", "user_1"))
	assert.NotEqual(t, ID("a_b", "c"), ID("a", "b_c"))
	assert.NotEqual(t, ID("a%5Fb", "c"), ID("a_b", "c"))
	assert.True(t, IsServiceDoc(ID("r", "d")))
	assert.True(t, IsServiceDoc(ProducerPositionID))
	assert.False(t, IsServiceDoc("my_rule"))
}

func TestStoreRoundTrip(t *testing.T) {
	srv := couchtest.Get(t)
	name := srv.NewDB(t, "cp_")
	s := NewStore(srv.Client.DB(name))
	ctx := t.Context()

	_, err := s.Position(ctx)
	require.ErrorIs(t, err, ErrNotFound)
	require.NoError(t, s.SavePosition(ctx, Position{LastSeq: "12-g1AAA", Source: "db_updates"}))
	require.NoError(t, s.SavePosition(ctx, Position{LastSeq: "13-g1AAA", Source: "db_updates"}))
	p, err := s.Position(ctx)
	require.NoError(t, err)
	assert.Equal(t, "13-g1AAA", p.LastSeq)

	require.NoError(t, s.SaveOnChange(ctx, OnChange{Rule: "hook_a", DB: "a/b+c$d", LastSeq: "7"}))
	cp, err := s.OnChange(ctx, "hook_a", "a/b+c$d")
	require.NoError(t, err)
	assert.Equal(t, "7", cp.LastSeq)
	require.NoError(t, s.DeleteDB(ctx, "a/b+c$d", []string{"hook_a", "other"}))
	_, err = s.OnChange(ctx, "hook_a", "a/b+c$d")
	assert.ErrorIs(t, err, ErrNotFound)
}

// Two stores writing the same doc (two producers) both succeed: conflicts are resolved.
func TestConcurrentWritersResolveConflicts(t *testing.T) {
	srv := couchtest.Get(t)
	name := srv.NewDB(t, "cp_")
	a, b := NewStore(srv.Client.DB(name)), NewStore(srv.Client.DB(name))
	ctx := t.Context()
	for i := range 5 {
		require.NoError(t, a.SavePosition(ctx, Position{LastSeq: "a"}))
		require.NoError(t, b.SavePosition(ctx, Position{LastSeq: "b"}), "round %d", i)
	}
	p, err := a.Position(ctx)
	require.NoError(t, err)
	assert.Equal(t, "b", p.LastSeq)
	require.NoError(t, a.SaveOnChange(ctx, OnChange{Rule: "r", DB: "d", LastSeq: "1"}))
	require.NoError(t, a.DeleteOnChange(ctx, "r", "d"))
	require.NoError(t, a.SaveOnChange(ctx, OnChange{Rule: "r", DB: "d", LastSeq: "2"}), "write after delete")
}
