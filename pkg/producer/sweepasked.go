package producer

import "sync"

// unchangedPairs remembers, per completion record key (reconcile.Key), the record and the db's
// update_seq for which CouchDB last said the db had no change after the record: the same pair
// again is the same state (an update_seq string names one state of the db), so the sweep need
// not ask again. One pair per key: a new answer replaces the old one. Keys of dbs deleted while
// the producer runs stay until it stops (two short strings each). The zero value is ready; it
// is safe for concurrent use.
type unchangedPairs struct {
	mu    sync.Mutex
	pairs map[string][2]string
}

// said reports whether CouchDB said that a db at update_seq seq had no change after record, the
// record of key.
func (u *unchangedPairs) said(key, record, seq string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	pair, ok := u.pairs[key]
	return ok && pair == [2]string{record, seq}
}

// remember records that CouchDB said a db at update_seq seq had no change after record.
func (u *unchangedPairs) remember(key, record, seq string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.pairs == nil {
		u.pairs = map[string][2]string{}
	}
	u.pairs[key] = [2]string{record, seq}
}

// forget drops what was remembered for key.
func (u *unchangedPairs) forget(key string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	delete(u.pairs, key)
}
