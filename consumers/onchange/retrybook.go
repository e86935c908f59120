package main

import (
	"cmp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
)

// bookTTL is how long a deferred request's attempt count is remembered without being touched
// (its rule was deleted, its db deleted, or another process finished it).
const bookTTL = 24 * time.Hour

// retryBook remembers, per deferred request, how many attempts were made and when the next is
// due, so that a job that deferred a request and runs again continues its backoff and counts
// towards its retry limit instead of starting over.
//
// It is in-process memory, shared with the other instances through the rule's checkpoint: the
// entries of a rule in a db are saved with its checkpoint when the rule stops at a deferred
// request (of), and a run that loads the checkpoint takes them in (seed), so a job that
// runs again in another process goes on with the same backoff and attempt count. Safe for
// concurrent use.
type retryBook struct {
	mu      sync.Mutex
	entries map[string]retryEntry
	now     func() time.Time
}

type retryEntry struct {
	attempts  int
	notBefore time.Time
	touched   time.Time
}

func newRetryBook() *retryBook {
	return &retryBook{entries: map[string]retryEntry{}, now: time.Now}
}

// bookKey identifies the request of one change of one rule in one db: the change by its doc and
// winning revision, not by its seq, which CouchDB 3 may send as another string when the feed is
// read from another point, nor by the request's body, which may carry that seq ($seq, $change).
func bookKey(rule, db, docID, rev string) string {
	return rule + "\x00" + db + "\x00" + docID + "\x00" + rev
}

// get returns the attempts made so far and how long until the next one is due (≤ 0: now);
// found is false when key has no entry.
func (b *retryBook) get(key string) (attempts int, wait time.Duration, found bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.entries[key]
	if !ok {
		return 0, 0, false
	}
	return e.attempts, e.notBefore.Sub(b.now()), true
}

// empty reports whether no request is booked.
func (b *retryBook) empty() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.entries) == 0
}

// defer records that key was attempted attempts times and is due again after wait.
func (b *retryBook) defer_(key string, attempts int, wait time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	if len(b.entries) > 0 && len(b.entries)%1024 == 0 {
		for k, e := range b.entries {
			if now.Sub(e.touched) > bookTTL {
				delete(b.entries, k)
			}
		}
	}
	b.entries[key] = retryEntry{attempts: attempts, notBefore: now.Add(wait), touched: now}
}

// forget drops key: its request succeeded or was given up.
func (b *retryBook) forget(key string) {
	b.mu.Lock()
	delete(b.entries, key)
	b.mu.Unlock()
}

// of returns the requests of rule in db that wait for a retry, for its checkpoint.
func (b *retryBook) of(rule, db string) []checkpoint.Retry {
	prefix := rule + "\x00" + db + "\x00"
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []checkpoint.Retry
	for k, e := range b.entries {
		rest, ok := strings.CutPrefix(k, prefix)
		if !ok {
			continue
		}
		doc, rev, _ := strings.Cut(rest, "\x00")
		out = append(out, checkpoint.Retry{Doc: doc, Rev: rev, Attempts: e.attempts, NotBefore: e.notBefore.UTC()})
	}
	slices.SortFunc(out, func(a, b checkpoint.Retry) int { return cmp.Or(cmp.Compare(a.Doc, b.Doc), cmp.Compare(a.Rev, b.Rev)) })
	return out
}

// seed takes in the deferred requests of rule in db that its checkpoint names (saved by another
// instance, or by this one before a restart). An entry this process holds with more attempts is
// kept.
func (b *retryBook) seed(rule, db string, rs []checkpoint.Retry) {
	if len(rs) == 0 {
		return
	}
	now := b.now()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range rs {
		k := bookKey(rule, db, r.Doc, r.Rev)
		if e, ok := b.entries[k]; ok && e.attempts >= r.Attempts {
			continue
		}
		b.entries[k] = retryEntry{attempts: r.Attempts, notBefore: r.NotBefore, touched: now}
	}
}
