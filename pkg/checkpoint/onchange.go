package checkpoint

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchpath"
)

// LocalPrefix starts the id of every on_change checkpoint: "_local/spiegel_onchange_<rule>".
const LocalPrefix = "spiegel_onchange_"

// ErrMoved means an on_change checkpoint is not where its reader left it: the watched db was
// deleted (and maybe recreated), or `producer replay` reset it. The run that found out must not
// save its progress: it starts again from the stored checkpoint.
var ErrMoved = errors.New("the checkpoint was moved meanwhile")

// OnChangeStore keeps the checkpoint of each (on_change rule, db) where CouchDB's own replicator
// keeps its checkpoints: a _local doc in the watched db. _local docs appear in no _changes or
// _db_updates feed, are not replicated, and vanish with a deleted db, so that a recreated db
// starts from its beginning by itself. A NATS key-value bucket caches them, so that a job
// reads no checkpoint from CouchDB: a job that makes progress costs its _changes read and a
// _local write (at most one per LocalEvery, see Save), and one that finds nothing new a _changes
// read and a _local read (the check that the cached checkpoint still exists: see Verify). Every
// CouchDB request ends at the client's request timeout. Safe for concurrent use.
type OnChangeStore struct {
	couch *couch.Client
	kv    jetstream.KeyValue // nil: no cache
	// LocalEvery, when above 0 and a cache is there, batches the _local writes of a busy
	// checkpoint: Save writes the cache entry (durable in JetStream) every time but the _local
	// doc only when it is older than LocalEvery. The doc then trails the entry by at most that
	// long; should the entry be lost, the changes in between are acted on once more
	// (at-least-once). Set it before use.
	LocalEvery time.Duration
	// ReplayID, when set, is the replay that Reset records in the checkpoints it resets (see
	// OnChangePoint.Replay). Set it before use.
	ReplayID string
}

// NewOnChangeStore returns the store over c's server, caching in kv (may be nil).
func NewOnChangeStore(c *couch.Client, kv jetstream.KeyValue) *OnChangeStore {
	return &OnChangeStore{couch: c, kv: kv}
}

// OnChangePoint is the checkpoint of one rule in one db as a run read it; Save updates it.
type OnChangePoint struct {
	Rule, DB string
	// LastSeq is the opaque seq up to which every change was acted on ("" = the beginning).
	LastSeq string
	// Found is false when the rule has no checkpoint in the db (a new rule or db).
	Found bool

	rev      string    // of the _local doc
	replayed string    // the doc's replayed_at: a replay changes it
	storedAt time.Time // when the _local doc was last written (zero: unknown)
	kvRev    uint64    // revision of the cache entry read (0: none)
	cached   bool      // read from the cache, not from CouchDB
}

// localDoc is the body of a checkpoint's _local doc.
type localDoc struct {
	Rev        string    `json:"_rev,omitempty"`
	Rule       string    `json:"rule"`
	LastSeq    string    `json:"last_seq"`
	ReplayedAt string    `json:"replayed_at,omitempty"`
	UpdatedAt  time.Time `json:"updated_at"`
}

// cacheEntry is the cached form of a checkpoint. Its LastSeq may be ahead of the _local doc's
// (OnChangeStore.LocalEvery); Rev and StoredAt are the doc's as last written.
type cacheEntry struct {
	LastSeq  string    `json:"last_seq"`
	Rev      string    `json:"rev"`
	Replayed string    `json:"replayed,omitempty"`
	StoredAt time.Time `json:"stored_at,omitzero"`
}

// Load returns the checkpoint of rule in db: from the cache, else from the _local doc. A
// missing checkpoint is Found false; a missing db is an error matching couch.ErrNotFound.
func (s *OnChangeStore) Load(ctx context.Context, rule, db string) (OnChangePoint, error) {
	p := OnChangePoint{Rule: rule, DB: db}
	if s.kv != nil {
		e, err := s.kv.Get(ctx, cacheKey(rule, db))
		var c cacheEntry
		if err == nil && json.Unmarshal(e.Value(), &c) == nil {
			p.LastSeq, p.rev, p.replayed, p.kvRev, p.Found, p.cached = c.LastSeq, c.Rev, c.Replayed, e.Revision(), true, true
			p.storedAt = c.StoredAt
			return p, nil
		}
		// No entry, or NATS did not answer: CouchDB has the checkpoint.
	}
	return s.read(ctx, p)
}

// read fills p from the _local doc.
func (s *OnChangeStore) read(ctx context.Context, p OnChangePoint) (OnChangePoint, error) {
	var d localDoc
	err := s.couch.DoIdempotent(ctx, http.MethodGet, localPath(s.couch, p.Rule, p.DB), nil, nil, &d)
	switch {
	case errors.Is(err, couch.ErrNotFound):
		// A missing doc and a missing db both answer 404: the caller's _changes read tells.
		p.LastSeq, p.rev, p.replayed, p.Found, p.cached = "", "", "", false, false
		return p, nil
	case err != nil:
		return p, fmt.Errorf("read checkpoint of rule %s in %s: %w", p.Rule, p.DB, err)
	}
	p.LastSeq, p.rev, p.replayed, p.Found, p.cached = d.LastSeq, d.Rev, d.ReplayedAt, true, false
	return p, nil
}

// Verify checks a checkpoint read from the cache against its _local doc, for a run that found
// nothing new after it (a cached seq of an earlier db of the same name, or one a replay reset,
// would otherwise find nothing new forever). It returns ErrMoved, and forgets the cache entry,
// when the doc is gone or was written by anyone else since. A checkpoint read from CouchDB
// needs no check.
func (s *OnChangeStore) Verify(ctx context.Context, p OnChangePoint) error {
	if !p.cached {
		return nil
	}
	cur, err := s.read(ctx, p)
	if err != nil {
		return err
	}
	if !cur.Found || cur.rev != p.rev {
		s.Forget(ctx, p.Rule, p.DB)
		return fmt.Errorf("checkpoint of rule %s in %s: %w", p.Rule, p.DB, ErrMoved)
	}
	return nil
}

// Save stores seq as p's checkpoint: first the cache entry, on condition that it is still the
// one p was read from (a replay, or anything that forgot the entry, since then makes it
// ErrMoved: CouchDB does not check the revs of _local docs, so the cache is what tells), then the
// _local doc — unless the entry is stored and the doc was written less than LocalEvery ago. When
// PouchDB Server refuses the doc's rev, the doc is read again: gone (the db was deleted and maybe
// recreated) or reset by a replay is ErrMoved; advanced by another process (whose run ended
// before this one started: one job per db at a time) is overwritten. On ErrMoved nothing of this
// run's progress stays behind: the next Load reads the doc. p is updated.
func (s *OnChangeStore) Save(ctx context.Context, p *OnChangePoint, seq string) error {
	moved := func() error {
		s.Forget(ctx, p.Rule, p.DB)
		return fmt.Errorf("save checkpoint of rule %s in %s: %w", p.Rule, p.DB, ErrMoved)
	}
	if !s.claim(ctx, p, seq) {
		return moved()
	}
	if p.kvRev != 0 && p.Found && p.rev != "" && s.LocalEvery > 0 && !p.storedAt.IsZero() && time.Since(p.storedAt) < s.LocalEvery {
		// The entry holds seq; the doc, written lately, trails it for now.
		p.LastSeq, p.cached = seq, true
		return nil
	}
	d := localDoc{Rev: p.rev, Rule: p.Rule, LastSeq: seq, ReplayedAt: p.replayed, UpdatedAt: time.Now().UTC()}
	rev, err := s.put(ctx, p.Rule, p.DB, d)
	if isConflict(err) || errors.Is(err, couch.ErrNotFound) { // 404: a rev of a doc that is gone
		cur, rerr := s.read(ctx, *p)
		switch {
		case rerr != nil:
			s.Forget(ctx, p.Rule, p.DB)
			return rerr
		case !cur.Found && p.Found, cur.Found && cur.replayed != p.replayed:
			return moved()
		}
		d.Rev = cur.rev
		rev, err = s.put(ctx, p.Rule, p.DB, d)
	}
	if err != nil {
		s.Forget(ctx, p.Rule, p.DB) // the cache is ahead of the doc: let the next Load read the doc
		return fmt.Errorf("save checkpoint of rule %s in %s: %w", p.Rule, p.DB, err)
	}
	p.LastSeq, p.rev, p.Found, p.storedAt = seq, rev, true, time.Now()
	s.cache(ctx, p)
	return nil
}

// claim writes seq into the cache entry over the revision p was read from (none: the entry must
// not exist). It reports false when that is not the entry any more; a cache that does not
// answer is left alone (true): the _local doc is written anyway.
func (s *OnChangeStore) claim(ctx context.Context, p *OnChangePoint, seq string) bool {
	if s.kv == nil {
		return true
	}
	v, _ := json.Marshal(cacheEntry{LastSeq: seq, Rev: p.rev, Replayed: p.replayed, StoredAt: p.storedAt})
	var rev uint64
	var err error
	if p.kvRev == 0 {
		rev, err = s.kv.Create(ctx, cacheKey(p.Rule, p.DB), v)
	} else {
		rev, err = s.kv.Update(ctx, cacheKey(p.Rule, p.DB), v, p.kvRev)
	}
	if err != nil {
		p.kvRev = 0
		return !isCASFailure(err)
	}
	p.kvRev = rev
	return true
}

// isCASFailure reports whether err is a key-value write refused because the key is not at the
// expected revision.
func isCASFailure(err error) bool {
	var apiErr *jetstream.APIError
	return errors.Is(err, jetstream.ErrKeyExists) ||
		errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence
}

// Reset sets the checkpoint of rule in db to seq ("" = the beginning) for `producer replay`,
// marking it as replayed (by s.ReplayID, if set): the cache entry first (a run in flight can then no longer claim it, see
// Save), then the _local doc, then the entry again with the doc's new rev.
func (s *OnChangeStore) Reset(ctx context.Context, rule, db, seq string) error {
	replayed := replayMark(time.Now().UTC().Format(time.RFC3339Nano), s.ReplayID)
	p := OnChangePoint{Rule: rule, DB: db, LastSeq: seq, replayed: replayed}
	s.put2cache(ctx, p)
	cur, err := s.read(ctx, OnChangePoint{Rule: rule, DB: db})
	if err != nil {
		return err
	}
	d := localDoc{Rev: cur.rev, Rule: rule, LastSeq: seq, ReplayedAt: replayed, UpdatedAt: time.Now().UTC()}
	if p.rev, err = s.put(ctx, rule, db, d); err != nil {
		return fmt.Errorf("reset checkpoint of rule %s in %s: %w", rule, db, err)
	}
	s.put2cache(ctx, p)
	return nil
}

// put2cache writes p's cache entry whatever is there.
func (s *OnChangeStore) put2cache(ctx context.Context, p OnChangePoint) {
	if s.kv == nil {
		return
	}
	v, _ := json.Marshal(cacheEntry{LastSeq: p.LastSeq, Rev: p.rev, Replayed: p.replayed})
	if _, err := s.kv.Put(ctx, cacheKey(p.Rule, p.DB), v); err != nil {
		s.Forget(ctx, p.Rule, p.DB)
	}
}

// Delete removes the checkpoint of rule in db, if any.
func (s *OnChangeStore) Delete(ctx context.Context, rule, db string) error {
	_, err := s.DeleteIfAny(ctx, rule, db)
	return err
}

// DeleteIfAny removes the checkpoint of rule in db and reports whether there was one.
func (s *OnChangeStore) DeleteIfAny(ctx context.Context, rule, db string) (bool, error) {
	s.Forget(ctx, rule, db)
	cur, err := s.read(ctx, OnChangePoint{Rule: rule, DB: db})
	if err != nil || !cur.Found {
		return false, err
	}
	err = s.couch.DoIdempotent(ctx, http.MethodDelete, localPath(s.couch, rule, db), map[string][]string{"rev": {cur.rev}}, nil, nil)
	if err != nil && !errors.Is(err, couch.ErrNotFound) {
		return false, fmt.Errorf("delete checkpoint of rule %s in %s: %w", rule, db, err)
	}
	return true, nil
}

// Forget drops the cache entry of rule in db (best effort): the next Load reads CouchDB.
func (s *OnChangeStore) Forget(ctx context.Context, rule, db string) {
	if s.kv != nil {
		_ = s.kv.Purge(ctx, cacheKey(rule, db))
	}
}

// cache records the rev of p's _local doc in its entry, over the revision claim wrote; an entry
// that cannot be written is forgotten (CouchDB has the checkpoint).
func (s *OnChangeStore) cache(ctx context.Context, p *OnChangePoint) {
	if s.kv == nil {
		return
	}
	if p.kvRev == 0 {
		s.Forget(ctx, p.Rule, p.DB)
		p.cached = false
		return
	}
	v, _ := json.Marshal(cacheEntry{LastSeq: p.LastSeq, Rev: p.rev, Replayed: p.replayed, StoredAt: p.storedAt})
	rev, err := s.kv.Update(ctx, cacheKey(p.Rule, p.DB), v, p.kvRev)
	if err != nil {
		s.Forget(ctx, p.Rule, p.DB)
		p.kvRev, p.cached = 0, false
		return
	}
	p.kvRev, p.cached = rev, true
}

func (s *OnChangeStore) put(ctx context.Context, rule, db string, d localDoc) (string, error) {
	var ans struct {
		Rev string `json:"rev"`
	}
	err := s.couch.DoIdempotent(ctx, http.MethodPut, localPath(s.couch, rule, db), nil, d, &ans)
	return ans.Rev, err
}

func isConflict(err error) bool {
	var he *couch.HTTPError
	return errors.As(err, &he) && he.Status == http.StatusConflict
}

// localPath is the request path of the checkpoint doc of rule in db.
func localPath(c *couch.Client, rule, db string) string {
	return c.DBPath(db) + "/_local/" + couchpath.Segment(LocalPrefix+rule)
}

// cacheKey is the cache key of rule in db: both base64url-encoded, so that any rule id and db
// name make a valid key.
func cacheKey(rule, db string) string {
	enc := base64.RawURLEncoding
	return enc.EncodeToString([]byte(rule)) + "." + enc.EncodeToString([]byte(db))
}

// legacyDoc is an on_change checkpoint as earlier releases kept it: a doc of the spiegel db.
type legacyDoc struct {
	ID         string `json:"_id"`
	Rev        string `json:"_rev"`
	Rule       string `json:"rule"`
	DB         string `json:"db"`
	LastSeq    string `json:"last_seq"`
	DBInstance string `json:"db_instance"`
}

// MigrateLegacy moves the on_change checkpoints that earlier releases kept as docs
// "spiegel_cp_<rule>_<db>" of the spiegel db into the watched dbs' _local docs, and deletes
// them: every write to the spiegel db was a _db_updates event. A checkpoint of a db that is gone,
// or was recreated since (another instance_start_time on CouchDB; an update_seq below the
// checkpoint's on PouchDB Server, whose seqs are integers), is deleted without a successor; one
// whose _local doc exists already (another process migrated it) too. It is safe to run in several
// processes at once, and returns how many it moved.
func (s *OnChangeStore) MigrateLegacy(ctx context.Context, spiegelDB string) (int, error) {
	moved := 0
	start := PrefixOnChange
	for {
		var page struct {
			Rows []struct {
				Doc *legacyDoc `json:"doc"`
			} `json:"rows"`
		}
		key, _ := json.Marshal(start)
		end, _ := json.Marshal(PrefixOnChange + "\ufff0")
		q := map[string][]string{"startkey": {string(key)}, "endkey": {string(end)}, "include_docs": {"true"}, "limit": {"500"}}
		if err := s.couch.Do(ctx, http.MethodGet, s.couch.DBPath(spiegelDB)+"/_all_docs", q, nil, &page); err != nil {
			return moved, fmt.Errorf("list the spiegel db's old checkpoints: %w", err)
		}
		n := 0
		for _, r := range page.Rows {
			if r.Doc == nil || r.Doc.ID == start && start != PrefixOnChange {
				continue
			}
			n++
			start = r.Doc.ID
			ok, err := s.migrate(ctx, *r.Doc)
			if err != nil {
				return moved, err
			}
			if ok {
				moved++
			}
			err = s.couch.DoIdempotent(ctx, http.MethodDelete, s.couch.DBPath(spiegelDB)+"/"+couchpath.Segment(r.Doc.ID),
				map[string][]string{"rev": {r.Doc.Rev}}, nil, nil)
			if err != nil && !errors.Is(err, couch.ErrNotFound) && !isConflict(err) {
				return moved, fmt.Errorf("delete old checkpoint %s: %w", r.Doc.ID, err)
			}
		}
		if n == 0 {
			return moved, nil
		}
	}
}

// migrate writes d's checkpoint as a _local doc unless its db is gone or recreated or one exists.
func (s *OnChangeStore) migrate(ctx context.Context, d legacyDoc) (bool, error) {
	if d.Rule == "" || d.DB == "" {
		return false, nil
	}
	info, err := s.couch.DBInfo(ctx, d.DB)
	switch {
	case errors.Is(err, couch.ErrNotFound):
		return false, nil
	case err != nil:
		return false, err
	case d.DBInstance != "" && info.InstanceStartTime != "" && d.DBInstance != info.InstanceStartTime:
		return false, nil
	}
	if old, err1 := strconv.ParseUint(d.LastSeq, 10, 64); err1 == nil {
		if cur, err2 := strconv.ParseUint(info.UpdateSeq, 10, 64); err2 == nil && cur < old {
			return false, nil
		}
	}
	cur, err := s.read(ctx, OnChangePoint{Rule: d.Rule, DB: d.DB})
	if err != nil || cur.Found {
		return false, err
	}
	_, err = s.put(ctx, d.Rule, d.DB, localDoc{Rule: d.Rule, LastSeq: d.LastSeq, UpdatedAt: time.Now().UTC()})
	if isConflict(err) {
		return false, nil // another process migrated it
	}
	if err != nil {
		return false, fmt.Errorf("migrate checkpoint of rule %s in %s: %w", d.Rule, d.DB, err)
	}
	return true, nil
}
