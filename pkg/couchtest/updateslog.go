package couchtest

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"hash/crc32"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Event types of _db_updates.
const (
	updateCreated = "created"
	updateUpdated = "updated"
	updateDeleted = "deleted"
)

// seqMarker starts the opaque part of every seq, as in CouchDB 3's "12-g1AAAA…".
const seqMarker = "g1AAAA"

// updateKey names one row of the feed: CouchDB 3 keeps one row per (type, db), so a second write
// of the same kind moves the row to a newer seq instead of adding one.
type updateKey struct{ db, typ string }

// updateRow is one row of the feed at its seq.
type updateRow struct {
	updateKey
	seq uint64
}

// updatesLog is the synthesized _db_updates feed. Observed writes wait for up to window (CouchDB's
// max_write_delay), then get consecutive seqs in the order of their latest write; each
// (type, db) is listed once, at the seq of its latest write. It is safe for concurrent use.
type updatesLog struct {
	tag    [8]byte // this log's identity inside every seq it hands out
	window time.Duration

	mu      sync.Mutex
	seq     uint64               // last seq handed out; 0 = the beginning
	rows    map[updateKey]uint64 // latest seq of each (type, db)
	pending []updateKey          // awaiting a seq, in order of their latest write
	timer   *time.Timer          // flushes pending after window; nil when none pending
	gen     uint64               // identifies the current timer
	changed chan struct{}        // closed and replaced whenever seq advances
	held    bool                 // pending rows wait for release
	closed  bool
	timers  sync.WaitGroup // running or armed flush timers
}

func newUpdatesLog(window time.Duration) *updatesLog {
	l := &updatesLog{window: window, rows: map[updateKey]uint64{}, changed: make(chan struct{})}
	_, _ = rand.Read(l.tag[:]) // never fails (crypto/rand)
	return l
}

// record notes a write of typ to db. The row gets its seq after the window, or at once when the
// window is 0: either way after every seq handed out before record was called.
func (l *updatesLog) record(db, typ string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	k := updateKey{db: db, typ: typ}
	l.pending = slices.DeleteFunc(l.pending, func(p updateKey) bool { return p == k })
	l.pending = append(l.pending, k)
	if l.held {
		return
	}
	if l.window <= 0 {
		l.flushLocked()
		return
	}
	if l.timer == nil {
		l.gen++
		gen := l.gen
		l.timers.Add(1)
		l.timer = time.AfterFunc(l.window, func() {
			defer l.timers.Done()
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.gen == gen && !l.closed {
				l.timer = nil
				l.flushLocked()
			}
		})
	}
}

// flush gives the pending rows their seqs now.
func (l *updatesLog) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stopTimerLocked()
	l.flushLocked()
}

// hold keeps rows pending, however long, until release.
func (l *updatesLog) hold() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.held = true
	l.stopTimerLocked()
}

// release ends hold and gives the pending rows their seqs now.
func (l *updatesLog) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.held = false
	l.flushLocked()
}

func (l *updatesLog) flushLocked() {
	if len(l.pending) == 0 {
		return
	}
	for _, k := range l.pending {
		l.seq++
		l.rows[k] = l.seq
	}
	l.pending = l.pending[:0]
	close(l.changed)
	l.changed = make(chan struct{})
}

func (l *updatesLog) stopTimerLocked() {
	if l.timer != nil && l.timer.Stop() {
		l.timers.Done() // its func will not run
	}
	l.timer = nil
	l.gen++
}

// close drops pending rows, stops the timer and waits for a running one.
func (l *updatesLog) close() {
	l.mu.Lock()
	l.closed = true
	l.stopTimerLocked()
	l.pending = nil
	l.mu.Unlock()
	l.timers.Wait()
}

// last returns the last seq handed out.
func (l *updatesLog) last() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.seq
}

// read returns the rows after since in seq order, at most limit of them (limit < 0: all), the
// position after them (the last row's seq when limit cut the list, since when limit is 0, the
// current seq otherwise), and a channel closed when the seq next advances.
func (l *updatesLog) read(since uint64, limit int) ([]updateRow, uint64, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var rows []updateRow
	for k, seq := range l.rows {
		if seq > since {
			rows = append(rows, updateRow{updateKey: k, seq: seq})
		}
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].seq < rows[j].seq })
	switch {
	case limit == 0:
		return nil, since, l.changed
	case limit > 0 && len(rows) > limit:
		rows = rows[:limit]
		return rows, rows[len(rows)-1].seq, l.changed
	}
	return rows, max(l.seq, since), l.changed
}

// encode returns seq n as an opaque CouchDB-3-style string: "<n>-g1AAAA" and the base64url of n,
// the log's tag and a checksum of both.
func (l *updatesLog) encode(n uint64) string {
	var b [20]byte
	binary.BigEndian.PutUint64(b[:8], n)
	copy(b[8:16], l.tag[:])
	binary.BigEndian.PutUint32(b[16:], crc32.ChecksumIEEE(b[:16]))
	return strconv.FormatUint(n, 10) + "-" + seqMarker + base64.RawURLEncoding.EncodeToString(b[:])
}

// parse returns the position a since value names: "" and "0" are the beginning, any other value
// must be a seq this log encoded and handed out (not a later one, not another log's). ok is false
// for anything else, "now" included (the caller resolves it).
func (l *updatesLog) parse(s string) (n uint64, ok bool) {
	if s == "" || s == "0" {
		return 0, true
	}
	num, rest, found := strings.Cut(s, "-")
	if !found || !strings.HasPrefix(rest, seqMarker) {
		return 0, false
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil || strconv.FormatUint(n, 10) != num {
		return 0, false
	}
	b, err := base64.RawURLEncoding.DecodeString(rest[len(seqMarker):])
	if err != nil || len(b) != 20 {
		return 0, false
	}
	if binary.BigEndian.Uint64(b[:8]) != n || [8]byte(b[8:16]) != l.tag ||
		binary.BigEndian.Uint32(b[16:]) != crc32.ChecksumIEEE(b[:16]) {
		return 0, false
	}
	if n > l.last() {
		return 0, false
	}
	return n, true
}
