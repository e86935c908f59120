package publisher

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The streaks of dbs written once (no feed earned) are forgotten after the idle time, and so is
// their memory: 100,000 dbs written once each, as a first sync or a tenant migration does,
// leave nothing once they are quiet. A Go map keeps the room of its biggest size, so without a
// fresh map the burst's room (7 MiB here) would stay for the process's life. Not
// parallel: it reads the process's heap.
func TestHotFeedStreaksGiveBackTheirMemory(t *testing.T) {
	const n = 100_000
	r := newHotRig(t, 1, time.Minute)
	var mu sync.Mutex
	now := time.Now()
	r.hot.mu.Lock()
	r.hot.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	r.hot.mu.Unlock()
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("tenant_%07d", i)
	}
	before := liveHeap()
	for _, db := range names {
		r.hot.Seen(db)
	}
	grown := liveHeap()
	require.Greater(t, grown-before, int64(2<<20), "the streaks take room (test precondition)")
	mu.Lock()
	now = now.Add(2 * time.Minute)
	mu.Unlock()
	r.hot.tidy()
	r.hot.mu.Lock()
	left := len(r.hot.recent)
	r.hot.mu.Unlock()
	require.Zero(t, left, "every streak is forgotten after the idle time")
	kept := liveHeap() - before
	t.Logf("streaks %d KiB, kept %d KiB", (grown-before)>>10, kept>>10)
	assert.Less(t, kept, int64(512<<10), "heap kept once every streak was forgotten")
	runtime.KeepAlive(names)
	runtime.KeepAlive(r)
}

// liveHeap returns the bytes of live heap objects after a collection.
func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}
