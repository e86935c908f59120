package rules

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// DefaultCacheSize bounds the per-db cache of Set.Groups; when full it is dropped wholesale.
const DefaultCacheSize = 200_000

// Change says what one Set.Apply did. Added is the new or edited rule (possibly disabled: check
// Enabled), Removed the rule it replaced or deleted; both nil when nothing changed. An edit has
// both, so the caller can enqueue the dbs matching Added at once (SPEC §4.6).
type Change struct {
	Added   Rule
	Removed Rule
}

// Stats counts the rules of a Set.
type Stats struct {
	Replicators int // enabled replicator rules
	OnChanges   int // enabled on_change rules
	Disabled    int // disabled rules of either kind
	Rejected    int // docs currently rejected as invalid
	// RejectedTotal counts every rejection since the Set was made (for a counter metric).
	RejectedTotal uint64
	// RejectedIDs maps each rejected doc id to its reason (passwords redacted).
	RejectedIDs map[string]string
}

// Set is the live rule set, fed from the spiegel db's _changes by Apply. It is safe for
// concurrent use: readers share a read lock and never block each other; Groups answers repeated
// db names from a lock-free-read cache that every change of the set drops.
type Set struct {
	mu            sync.RWMutex
	rules         map[string]Rule
	rejected      map[string]string
	rejectedTotal uint64
	gen           uint64
	idx           *index
	cacheSize     int
	cache         atomic.Pointer[groupCache]
	policy        Policy
}

// NewSet returns an empty set that parses rules with the zero Policy.
func NewSet() *Set { return NewSetWith(Policy{}) }

// NewSetWith returns an empty set that parses rules under p (see ParseWith).
func NewSetWith(p Policy) *Set {
	s := &Set{rules: map[string]Rule{}, rejected: map[string]string{}, idx: newIndex(), cacheSize: DefaultCacheSize, policy: p}
	s.cache.Store(newGroupCache(0))
	return s
}

// Apply upserts or deletes the rule of one doc of the spiegel db (deleted: the doc was deleted;
// raw is then ignored). Outcomes:
//   - a valid rule replaces the one with the same id (a doc whose _rev equals the current rule's
//     changes nothing and returns a zero Change);
//   - an invalid rule doc removes the rule with that id, records the id as rejected and returns
//     the *ValidationError (log it once; its text holds no password);
//   - a doc that is not a rule (ErrNotRule) or a deleted doc removes the rule with that id, if
//     any, and returns no error.
//
// Every change bumps Generation and drops the Groups cache.
func (s *Set) Apply(id string, raw []byte, deleted bool) (Change, error) {
	var r Rule
	var perr error
	if !deleted {
		r, perr = ParseWith(id, raw, s.policy)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.rules[id]
	switch {
	case deleted || errors.Is(perr, ErrNotRule):
		_, wasRejected := s.rejected[id]
		delete(s.rejected, id)
		if old == nil {
			if wasRejected {
				s.bump()
			}
			return Change{}, nil
		}
		s.drop(old)
		s.bump()
		return Change{Removed: old}, nil
	case perr != nil:
		s.rejected[id] = logging.RedactText(perr.Error())
		s.rejectedTotal++
		if old != nil {
			s.drop(old)
		}
		s.bump()
		return Change{Removed: old}, perr
	}
	if old != nil && old.Rev() != "" && old.Rev() == r.Rev() {
		return Change{}, nil
	}
	delete(s.rejected, id)
	if old != nil {
		s.drop(old)
	}
	s.rules[id] = r
	if r.Enabled() {
		s.idx.add(r)
	}
	s.bump()
	return Change{Added: r, Removed: old}, nil
}

func (s *Set) drop(r Rule) {
	delete(s.rules, r.ID())
	if r.Enabled() {
		s.idx.remove(r)
	}
}

// bump starts a new generation; callers hold s.mu for writing.
func (s *Set) bump() {
	s.gen++
	s.cache.Store(newGroupCache(s.gen))
}

// Generation returns a number that grows with every change of the set.
func (s *Set) Generation() uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.gen
}

// Groups returns the groups that have at least one enabled rule matching db. Repeated names are
// answered from a cache (bounded by DefaultCacheSize, dropped on every change).
func (s *Set) Groups(db string) GroupMask {
	c := s.cache.Load()
	if m, ok := c.get(db); ok {
		return m
	}
	s.mu.RLock()
	m := s.idx.groups(db)
	gen := s.gen
	s.mu.RUnlock()
	if gen == c.gen && c.put(db, m) > s.cacheSize {
		s.cache.CompareAndSwap(c, newGroupCache(gen))
	}
	return m
}

// Replicators returns the enabled replicator rules matching db, sorted by id.
func (s *Set) Replicators(db string) []*Replicator {
	var out []*Replicator
	for _, r := range s.matching(db) {
		if x, ok := r.(*Replicator); ok {
			out = append(out, x)
		}
	}
	return out
}

// OnChanges returns the enabled on_change rules matching db, sorted by id.
func (s *Set) OnChanges(db string) []*OnChange {
	var out []*OnChange
	for _, r := range s.matching(db) {
		if x, ok := r.(*OnChange); ok {
			out = append(out, x)
		}
	}
	return out
}

func (s *Set) matching(db string) []Rule {
	s.mu.RLock()
	rs := s.idx.rules(db)
	s.mu.RUnlock()
	sort.Slice(rs, func(i, j int) bool { return rs[i].ID() < rs[j].ID() })
	return rs
}

// Fingerprint identifies the enabled rules of group g that match db, with their revisions: 16
// hex digits of a SHA-256 over their ids and revs ("" when none match). A completion record
// keeps it (reconcile.Value), so that the sweep sees a db whose rules changed since its last
// job as due.
func (s *Set) Fingerprint(g events.Group, db string) string {
	if s == nil {
		return ""
	}
	h := sha256.New()
	n := 0
	for _, r := range s.matching(db) {
		if r.Group() != g || !r.Enabled() {
			continue
		}
		n++
		fmt.Fprintf(h, "%s\x00%s\n", r.ID(), r.Rev())
	}
	if n == 0 {
		return ""
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// Rule returns the rule with the given doc id, enabled or not.
func (s *Set) Rule(id string) (Rule, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	r, ok := s.rules[id]
	return r, ok
}

// All returns every rule, enabled or not, sorted by id.
func (s *Set) All() []Rule {
	s.mu.RLock()
	out := make([]Rule, 0, len(s.rules))
	for _, r := range s.rules {
		out = append(out, r)
	}
	s.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID() < out[j].ID() })
	return out
}

// Stats counts the rules; RejectedIDs is a fresh copy.
func (s *Set) Stats() Stats {
	s.mu.RLock()
	defer s.mu.RUnlock()
	st := Stats{Rejected: len(s.rejected), RejectedTotal: s.rejectedTotal, RejectedIDs: make(map[string]string, len(s.rejected))}
	for id, reason := range s.rejected {
		st.RejectedIDs[id] = reason
	}
	for _, r := range s.rules {
		switch {
		case !r.Enabled():
			st.Disabled++
		case r.Kind() == KindReplicator:
			st.Replicators++
		default:
			st.OnChanges++
		}
	}
	return st
}

// groupCache maps db names to their GroupMask for one generation of a Set. Sharded maps under
// read-write locks: a hit costs a hash, an uncontended RLock and a map lookup.
type groupCache struct {
	gen    uint64
	seed   maphash.Seed
	n      atomic.Int64
	shards [32]cacheShard
}

type cacheShard struct {
	mu sync.RWMutex
	m  map[string]GroupMask
}

func newGroupCache(gen uint64) *groupCache {
	return &groupCache{gen: gen, seed: maphash.MakeSeed()}
}

func (c *groupCache) shard(db string) *cacheShard {
	return &c.shards[maphash.String(c.seed, db)%uint64(len(c.shards))]
}

func (c *groupCache) get(db string) (GroupMask, bool) {
	sh := c.shard(db)
	sh.mu.RLock()
	m, ok := sh.m[db]
	sh.mu.RUnlock()
	return m, ok
}

// put stores m for db and returns the number of entries.
func (c *groupCache) put(db string, m GroupMask) int {
	sh := c.shard(db)
	sh.mu.Lock()
	if sh.m == nil {
		sh.m = map[string]GroupMask{}
	}
	_, had := sh.m[db]
	if !had {
		sh.m[strings.Clone(db)] = m // the caller's string may pin a large feed buffer
	}
	sh.mu.Unlock()
	if had {
		return int(c.n.Load())
	}
	return int(c.n.Add(1))
}
