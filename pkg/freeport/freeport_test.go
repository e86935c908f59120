package freeport

import (
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Ports are distinct, free, below the ephemeral range, and never handed out twice.
func TestPorts(t *testing.T) {
	t.Parallel()
	seen := map[int]bool{}
	for range 20 {
		ps, err := Ports(5)
		require.NoError(t, err)
		require.Len(t, ps, 5)
		for _, p := range ps {
			assert.False(t, seen[p], "port %d handed out twice", p)
			seen[p] = true
			assert.GreaterOrEqual(t, p, low)
			assert.Less(t, p, ephemeralLow())
			ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
			require.NoError(t, err, "port %d is free", p)
			_ = ln.Close()
		}
	}
	addr, err := Addr()
	require.NoError(t, err)
	assert.Regexp(t, `^127\.0\.0\.1:\d+$`, addr)
}
