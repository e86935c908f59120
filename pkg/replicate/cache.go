package replicate

import (
	"container/list"
	"sync"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// cachedHistory bounds the history entries a cached checkpoint keeps: enough to find a common
// session with the other side, without holding 50 sessions for every replication in memory.
const cachedHistory = 10

// CheckpointCache keeps, per replication id, the checkpoint docs that a run of this process
// last read or wrote on both sides, so that the next run of the same replication within MaxAge
// does not read them again. An entry is verified, never trusted: a run that uses it reads the
// target's checkpoint doc (one request instead of the two reads) before its first checkpoint
// write and before it reports success, and when that doc is not the cached one — the target was
// deleted and recreated, restored from a backup, or another process ran the replication since —
// the entry is dropped and the run starts again from both checkpoints (see run.targetCheck).
// MaxAge bounds the memory an idle entry holds.
// Safe for concurrent use.
type CheckpointCache struct {
	maxAge  time.Duration
	max     int
	mu      sync.Mutex
	order   *list.List // of ids, most recently used first
	entries map[string]*cacheEntry
}

type cacheEntry struct {
	src, tgt checkpointDoc
	// progress is where the runs whose checkpoints were deferred got to: every change up to it
	// is on the target, but the checkpoints say less. The next run starts there.
	progress progress
	at       time.Time
	elem     *list.Element
}

// NewCheckpointCache returns a cache of at most max replications (least recently used dropped
// first) whose entries are trusted for maxAge.
func NewCheckpointCache(maxAge time.Duration, max int) *CheckpointCache {
	return &CheckpointCache{maxAge: maxAge, max: max, order: list.New(), entries: map[string]*cacheEntry{}}
}

// progress is where the runs of a replication whose checkpoints were deferred got to.
type progress struct {
	seq couch.Seq // every change up to it is on the target ("": no deferred run)
	// changes is the number of changes those runs read past the checkpoints
	changes int
}

// get returns copies of the cached checkpoint docs of replication id, if fresh, and the
// progress of deferred runs since (zero if none).
func (c *CheckpointCache) get(id string) (src, tgt *checkpointDoc, p progress, ok bool) {
	if c == nil {
		return nil, nil, progress{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	e, found := c.entries[id]
	if !found {
		return nil, nil, progress{}, false
	}
	if time.Since(e.at) > c.maxAge {
		c.removeLocked(id, e)
		return nil, nil, progress{}, false
	}
	c.order.MoveToFront(e.elem)
	s, t := e.src, e.tgt
	s.History, t.History = append([]historyEntry(nil), e.src.History...), append([]historyEntry(nil), e.tgt.History...)
	return &s, &t, e.progress, true
}

// advance records where the deferred runs of replication id got to.
func (c *CheckpointCache) advance(id string, p progress) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, found := c.entries[id]; found {
		e.progress = p
	}
}

// put records the checkpoint docs of replication id as both sides hold them now.
func (c *CheckpointCache) put(id string, src, tgt checkpointDoc) {
	if c == nil {
		return
	}
	src.History, tgt.History = trimHistory(src.History), trimHistory(tgt.History)
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, found := c.entries[id]; found {
		e.src, e.tgt, e.progress, e.at = src, tgt, progress{}, time.Now()
		c.order.MoveToFront(e.elem)
		return
	}
	c.entries[id] = &cacheEntry{src: src, tgt: tgt, at: time.Now(), elem: c.order.PushFront(id)}
	for c.max > 0 && c.order.Len() > c.max {
		last := c.order.Back()
		c.removeLocked(last.Value.(string), c.entries[last.Value.(string)])
	}
}

// drop forgets replication id: its next run reads both checkpoints.
func (c *CheckpointCache) drop(id string) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, found := c.entries[id]; found {
		c.removeLocked(id, e)
	}
}

func (c *CheckpointCache) removeLocked(id string, e *cacheEntry) {
	c.order.Remove(e.elem)
	delete(c.entries, id)
}

func trimHistory(h []historyEntry) []historyEntry {
	if len(h) > cachedHistory {
		h = h[:cachedHistory]
	}
	return append([]historyEntry(nil), h...)
}
