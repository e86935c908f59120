package couchtest

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// CleanupPrefix removes the dbs a test's pipeline made under its prefix, created after the
// cleanup was registered, and leaves every other db alone.
func TestCleanupPrefix(t *testing.T) {
	s := Get(t)
	prefix := UniqueName(t, "ctcleanup_") + "_"
	other := s.NewDB(t, "ctcleanup_other_") // shares the first letters, not the prefix
	t.Run("sub", func(t *testing.T) {
		s.CleanupPrefix(t, prefix)
		for _, db := range []string{prefix + "a", prefix + "a_copy", prefix + "b+c"} {
			require.NoError(t, s.Do(t, http.MethodPut, "/"+PathDB(db), nil, nil))
		}
		assert.Len(t, s.prefixed(t, prefix), 3)
	})
	assert.Empty(t, s.prefixed(t, prefix), "the subtest's dbs are gone after it")
	assert.Contains(t, s.prefixed(t, "ctcleanup_other_"), other)
}
