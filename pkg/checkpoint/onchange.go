package checkpoint

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
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
// deleted (and maybe recreated) since, so the checkpoint read belonged to another db. The run
// that found out must not save its progress: it starts again from the stored checkpoint (Load).
var ErrMoved = errors.New("the checkpoint's db was deleted or recreated meanwhile")

// ErrFenced means another holder — a newer run of the same (rule, db), or `producer replay` —
// wrote the checkpoint since this run read it: the run no longer holds the checkpoint. It must
// stop its side effects and not retry the write; the checkpoint stays as the other holder left
// it. It is never returned for a cache that did not answer (that is a transient error).
var ErrFenced = errors.New("fenced: another holder wrote the checkpoint since this run read it")

// OnChangeStore keeps the checkpoint of each (on_change rule, db) where CouchDB's own replicator
// keeps its checkpoints: a _local doc in the watched db. _local docs appear in no _changes or
// _db_updates feed, are not replicated, and vanish with a deleted db. A NATS key-value entry per
// checkpoint caches it and fences it:
//
//   - Fencing. The entry's revision is the fencing token: Load reads it, and every Save first
//     moves the entry by a compare-and-set over the revision its run last read or wrote (claim),
//     and writes the _local doc only once the server confirmed that. A run that lost the
//     checkpoint to a newer run or a replay (which moves the revision too) gets ErrFenced and
//     writes nothing; a cache that does not answer is a transient error, never a write without
//     the claim. CouchDB 3 does not check the revs of _local docs, so the entry, not the doc's
//     rev, is what orders holders; PouchDB Server's rev check is a second fence.
//   - Verification. The cache is never trusted alone: Verify reads the _local doc and the db's
//     identity doc (IdentityID), with one request where the server has POST /{db}/_local_docs
//     (CouchDB 2+; two GETs in parallel elsewhere), in parallel with the run's first _changes
//     page. Every checkpoint records the identity of its db, created by the first checkpoint
//     that begins there: a db without it, or with another, is not the checkpoint's db — it was
//     deleted and created again, whatever its seqs and whatever checkpoint doc a late write left
//     in it: ErrMoved. A doc that is gone, or of another lineage (a random instance id written
//     in the checkpoint's first doc and kept in the entry), means the same. A doc of the same
//     lineage that is not the one the entry names (a write that landed after its holder was
//     fenced, or a doc trailing the entry) leaves the entry in charge; the next Save rewrites
//     the doc. Load, reading CouchDB, reads both docs too, and a doc naming another identity is
//     no checkpoint. Seqs are never read for any of this: a shard copy that CouchDB rebuilt
//     (new shard files in the seqs, the same db) keeps the identity.
//
// A job that makes progress costs its _changes read, one read of both _local docs per rule on
// CouchDB (on PouchDB Server the _local read and the identity read, shared by the job's rules,
// see identities) and a _local write (at most one per LocalEvery, see Save);
// the first checkpoint of a db creates its identity (a write, once, after Load found none) and
// writes its doc (Begin; the first page's Save then moves the entry only). Every CouchDB
// request ends at the client's request timeout. Safe for concurrent use.
type OnChangeStore struct {
	couch *couch.Client
	kv    jetstream.KeyValue // nil: no cache and no fencing but PouchDB Server's rev check
	ids   identities         // the identity requests under way, shared by a job's rules
	// LocalEvery, when above 0 and a cache is there, batches the _local writes of a busy
	// checkpoint: Save writes the cache entry (durable in JetStream) every time but the _local
	// doc only when it is older than LocalEvery. The doc then trails the entry by at most that
	// long; should the entry be lost, the changes in between are acted on once more
	// (at-least-once). Set it before use.
	LocalEvery time.Duration
	// LocalChanges, when above 0 (with LocalEvery), leaves a doc older than LocalEvery behind
	// too while it trails the entry by fewer than LocalChanges changes (OnChangePoint.Acted): a
	// db written now and then would otherwise write its doc with nearly every change. Should the
	// entry be lost, at most that many changes, or LocalEvery's worth, are acted on once more.
	// Set it before use.
	LocalChanges int
	// ReplayID, when set, is the replay that Reset records in the checkpoints it resets (see
	// OnChangePoint.Replay). Set it before use.
	ReplayID string
}

// NewOnChangeStore returns the store over c's server, caching in kv (may be nil).
func NewOnChangeStore(c *couch.Client, kv jetstream.KeyValue) *OnChangeStore {
	return &OnChangeStore{couch: c, kv: kv}
}

// OnChangePoint is the checkpoint of one rule in one db as a run read it; Save updates it. It
// carries the run's fencing token: copy it only to hand it over, never to save from two copies.
type OnChangePoint struct {
	Rule, DB string
	// LastSeq is the opaque seq up to which every change was acted on ("" = the beginning).
	LastSeq string
	// Found is false when the rule has no checkpoint in the db (a new rule or db).
	Found bool
	// Stream is where a subject rule's last publish before LastSeq was stored (zero: unknown, or
	// not a subject rule): kept with the checkpoint so that a stream that lost messages it had
	// acknowledged is noticed (its subject's last message is older) and published again.
	Stream StreamPoint
	// Retries are the requests of the change after LastSeq that failed and wait for a retry: so
	// that whichever instance runs the rule next goes on with their backoff and attempt counts.
	Retries []Retry

	rev      string    // of the _local doc, as last written by a holder
	replayed string    // the doc's replayed_at: a replay changes it
	instance string    // the checkpoint's lineage, kept in its doc and entry ("": unknown)
	dbID     string    // the identity of the db the checkpoint is of, kept in its doc and entry ("": unknown)
	dbSeen   string    // the db's identity as the run last read it ("": none, or not read)
	dbNoneAt time.Time // when the run read the db's identity and found none (zero: it did not)
	storedAt time.Time // when the _local doc was last written (zero: unknown)
	kvRev    uint64    // the fencing token: the entry's revision read or last written (0: none)
	cached   bool      // read from the cache, not from CouchDB
	docStale bool      // the _local doc is not the entry's: the next Save writes it
	trail    int       // changes acted on since the _local doc was written (see Acted)
}

// Acted counts n more changes acted on since the _local doc was last written, for the next
// Save to weigh against OnChangeStore.LocalChanges.
func (p *OnChangePoint) Acted(n int) { p.trail += n }

// StreamPoint is a message stored on a subject: its stream sequence.
type StreamPoint struct {
	Subject string `json:"subject,omitempty"`
	Seq     uint64 `json:"seq,omitempty"`
	// Began says that Base and Start are known: the checkpoint began in its db (no checkpoint
	// before it, as in a db created again) when the subject's last message was Base (0: none),
	// from the feed seq Start. A message at or before Base is not a change of this checkpoint's
	// db: it may be one of an earlier db of the same name, whose feed seqs mean nothing here.
	Began bool   `json:"began,omitempty"`
	Base  uint64 `json:"base,omitempty"`
	Start string `json:"start,omitempty"`
}

// Retry is a deferred request of a rule in a db: the change's doc and winning revision, the
// attempts made so far and when the next is due.
type Retry struct {
	Doc       string    `json:"doc"`
	Rev       string    `json:"rev"`
	Attempts  int       `json:"attempts"`
	NotBefore time.Time `json:"not_before"`
}

// localDoc is the body of a checkpoint's _local doc.
type localDoc struct {
	Rev        string `json:"_rev,omitempty"`
	Rule       string `json:"rule"`
	LastSeq    string `json:"last_seq"`
	ReplayedAt string `json:"replayed_at,omitempty"`
	// Instance names the checkpoint's lineage: chosen at random by the first write, kept by the
	// later ones. It dies with the db; a db created again shows it only when a late write of the
	// earlier db's holder landed there (CouchDB 3 takes _local docs whatever their rev), which
	// DBID tells.
	Instance string `json:"instance,omitempty"`
	// DBID is the identity of the db the checkpoint is of (see IdentityID); absent from the
	// docs of earlier releases, which the next save completes.
	DBID string `json:"db_id,omitempty"`
	// Fence is the cache entry's revision that the write was made under (for the record).
	Fence     uint64      `json:"fence,omitempty"`
	Stream    StreamPoint `json:"stream,omitzero"`
	Retries   []Retry     `json:"retries,omitempty"`
	UpdatedAt time.Time   `json:"updated_at"`
}

// cacheEntry is the cached form of a checkpoint. Its LastSeq may be ahead of the _local doc's
// (OnChangeStore.LocalEvery); Rev and StoredAt are the doc's as last written.
type cacheEntry struct {
	LastSeq  string      `json:"last_seq"`
	Rev      string      `json:"rev"`
	Replayed string      `json:"replayed,omitempty"`
	Instance string      `json:"instance,omitempty"`
	DBID     string      `json:"db_id,omitempty"`
	StoredAt time.Time   `json:"stored_at,omitzero"`
	Stream   StreamPoint `json:"stream,omitzero"`
	Retries  []Retry     `json:"retries,omitempty"`
	// Trail is the number of changes acted on since the _local doc was written.
	Trail int `json:"trail,omitempty"`
}

func (p *OnChangePoint) entry(seq string) []byte {
	v, _ := json.Marshal(cacheEntry{LastSeq: seq, Rev: p.rev, Replayed: p.replayed, Instance: p.instance, DBID: p.dbID, StoredAt: p.storedAt, Stream: p.Stream, Retries: p.Retries, Trail: p.trail})
	return v
}

// Load returns the checkpoint of rule in db and the run's fencing token: from the cache, else
// from the _local doc, read with the db's identity (readWithIdentity). A cache that does not answer
// is an error (transient): the doc may trail the entry, so falling back to it would go back. A
// missing checkpoint is Found false; so is a doc naming another identity than the db's (one of
// an earlier db of the name), and a missing db (the caller's _changes read tells).
func (s *OnChangeStore) Load(ctx context.Context, rule, db string) (OnChangePoint, error) {
	p := OnChangePoint{Rule: rule, DB: db}
	if s.kv != nil {
		e, err := s.kv.Get(ctx, cacheKey(rule, db))
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			// No entry (never cached, or dropped): CouchDB has the checkpoint; the first Save
			// creates the entry, which fails if another holder created it first.
		case err != nil:
			return p, fmt.Errorf("read checkpoint of rule %s in %s from the cache: %w", rule, db, err)
		default:
			var c cacheEntry
			if json.Unmarshal(e.Value(), &c) == nil {
				p.LastSeq, p.rev, p.replayed, p.instance, p.storedAt, p.Stream, p.trail = c.LastSeq, c.Rev, c.Replayed, c.Instance, c.StoredAt, c.Stream, c.Trail
				p.Retries = c.Retries
				p.dbID = c.DBID
				p.kvRev, p.Found, p.cached = e.Revision(), true, true
				return p, nil
			}
			p.kvRev = e.Revision() // unreadable: the doc decides, the first Save replaces the entry
		}
	}
	readAt := time.Now()
	d, found, dbID, err := s.readWithIdentity(ctx, rule, db)
	if err != nil {
		return p, err
	}
	p.dbSeen, p.dbNoneAt = dbID, noneAt(dbID, readAt)
	if found && d.DBID != "" && d.DBID != dbID {
		// The doc is of an earlier db of this name (a write that landed after the db was created
		// again): this db has no checkpoint of the rule.
		found = false
	}
	if found {
		p.LastSeq, p.rev, p.replayed, p.instance, p.Stream, p.Found = d.LastSeq, d.Rev, d.ReplayedAt, d.Instance, d.Stream, true
		p.Retries = d.Retries
		p.dbID = d.DBID
	}
	return p, nil
}

// noneAt is readAt when id, the identity read then, is none; zero otherwise.
func noneAt(id string, readAt time.Time) time.Time {
	if id != "" {
		return time.Time{}
	}
	return readAt
}

// Cached reports whether p was read from the cache, so that Verify has something to check.
func (p OnChangePoint) Cached() bool { return p.cached }

// readDoc reads the _local doc of rule in db; a missing doc and a missing db are found false.
func (s *OnChangeStore) readDoc(ctx context.Context, rule, db string) (localDoc, bool, error) {
	var d localDoc
	err := s.couch.DoIdempotent(ctx, http.MethodGet, localPath(s.couch, rule, db), nil, nil, &d)
	switch {
	case errors.Is(err, couch.ErrNotFound):
		return localDoc{}, false, nil
	case err != nil:
		return localDoc{}, false, fmt.Errorf("read checkpoint of rule %s in %s: %w", rule, db, err)
	}
	return d, true, nil
}

// Verify checks a checkpoint read from the cache against its _local doc and its db's identity
// (a checkpoint read from CouchDB needs no check: Load read both). A db whose identity is not
// the one the entry names (none, or another) was deleted and created again since, whatever
// checkpoint doc it holds; a doc that is gone while the entry names one, or that is of another
// lineage, means the same. Verify then drops the entry (over the run's token) and returns
// ErrMoved; the run starts again from Load. A doc of the same lineage that differs from the
// entry's, or one of an earlier db of the name (a late write) while the entry is this db's, is
// rewritten by the next Save (the entry is the checkpoint: a holder writes the doc only after
// moving the entry). An entry of an earlier release names no identity: the lineage alone
// decides, and the next Save records the identity. A CouchDB or cache that does not answer is
// a transient error; an entry moved by another holder meanwhile is ErrFenced. It makes one
// CouchDB request (two in parallel on a server without POST /{db}/_local_docs, the identity
// read shared with the job's other rules, see identities) and, on ErrMoved, one cache write. p
// is updated.
func (s *OnChangeStore) Verify(ctx context.Context, p *OnChangePoint) error {
	if !p.cached {
		return nil
	}
	readAt := time.Now()
	d, found, dbID, err := s.readWithIdentity(ctx, p.Rule, p.DB)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	p.dbSeen, p.dbNoneAt = dbID, noneAt(dbID, readAt)
	switch {
	case p.dbID != "" && p.dbID != dbID: // the db was created again
		return s.moved(ctx, p, "verify")
	case found && d.DBID != "" && d.DBID != dbID: // a doc of an earlier db of the name
		if p.dbID == "" { // nothing says that the entry is this db's either
			return s.moved(ctx, p, "verify")
		}
		p.docStale = true
	case !found && (p.rev != "" || p.instance != ""),
		found && p.instance != "" && d.Instance != p.instance,
		found && p.instance == "" && d.Rev != p.rev: // an entry of an earlier release: no lineage to compare
		return s.moved(ctx, p, "verify")
	case !found || d.Rev != p.rev:
		p.docStale = true
	}
	return nil
}

// moved drops p's cache entry over p's token and returns ErrMoved (or why it could not).
func (s *OnChangeStore) moved(ctx context.Context, p *OnChangePoint, op string) error {
	if s.kv != nil && p.kvRev != 0 {
		err := s.kv.Delete(ctx, cacheKey(p.Rule, p.DB), jetstream.LastRevision(p.kvRev))
		switch {
		case isCASFailure(err):
			return fmt.Errorf("%s checkpoint of rule %s in %s: %w", op, p.Rule, p.DB, ErrFenced)
		case err != nil:
			return fmt.Errorf("%s checkpoint of rule %s in %s: drop the cache entry: %w", op, p.Rule, p.DB, err)
		}
	}
	p.kvRev, p.cached = 0, false
	return fmt.Errorf("%s checkpoint of rule %s in %s: %w", op, p.Rule, p.DB, ErrMoved)
}

// Save stores seq as p's checkpoint, fenced by p's token:
//  1. claim: the cache entry is moved to seq by a compare-and-set over the revision p holds
//     (none: the entry must not exist). Refused: ErrFenced, nothing written. No answer: a
//     transient error, nothing written.
//  2. the _local doc — unless it is the entry's and was written less than LocalEvery ago or
//     fewer than LocalChanges changes ago. When
//     PouchDB Server refuses the doc's rev, the doc is read again: gone (the db was deleted) is
//     ErrMoved; an entry no longer at p's token (a replay, a newer holder) is ErrFenced;
//     otherwise (a late write of a fenced holder) the doc is overwritten.
//  3. the entry records the doc's new rev, over the claim's revision (refused: ErrFenced).
//
// An error after the claim leaves the entry ahead of the doc, as LocalEvery does. p is updated.
func (s *OnChangeStore) Save(ctx context.Context, p *OnChangePoint, seq string) error {
	return s.save(ctx, p, seq, false)
}

func (s *OnChangeStore) save(ctx context.Context, p *OnChangePoint, seq string, now bool) error {
	if p.instance == "" { // a new checkpoint, or a doc of an earlier release
		p.instance, p.docStale = newInstance(), true
	}
	if p.dbID == "" { // a new checkpoint, or one of an earlier release: it records the db's identity
		id := p.dbSeen
		if id == "" {
			var err error
			if id, err = s.ensureIdentity(ctx, p.DB, p.dbNoneAt); err != nil {
				return fmt.Errorf("save checkpoint of rule %s in %s: %w", p.Rule, p.DB, err)
			}
		}
		p.dbID, p.docStale = id, true
	}
	if err := s.claim(ctx, p, seq); err != nil {
		return err
	}
	if !now && !p.docStale && p.kvRev != 0 && p.Found && p.rev != "" && s.LocalEvery > 0 && !p.storedAt.IsZero() &&
		(time.Since(p.storedAt) < s.LocalEvery || p.trail < s.LocalChanges) {
		// The entry holds seq; the doc, written lately or a few changes behind, trails it for now.
		p.LastSeq, p.cached = seq, true
		return nil
	}
	d := localDoc{Rev: p.rev, Rule: p.Rule, LastSeq: seq, ReplayedAt: p.replayed, Instance: p.instance, DBID: p.dbID, Fence: p.kvRev, Stream: p.Stream, Retries: p.Retries, UpdatedAt: time.Now().UTC()}
	rev, err := s.put(ctx, p.Rule, p.DB, d)
	if isConflict(err) || errors.Is(err, couch.ErrNotFound) { // 404: a rev of a doc that is gone
		cur, found, rerr := s.readDoc(ctx, p.Rule, p.DB)
		switch {
		case rerr != nil:
			return fmt.Errorf("save: %w", rerr)
		case !found && p.Found && p.rev != "",
			found && cur.Instance != "" && cur.Instance != p.instance && !p.docStale:
			return s.moved(ctx, p, "save")
		}
		// Written since by a replay (which moved the entry first) or by a holder fenced since
		// (a late write): the entry tells which.
		if err := s.stillHeld(ctx, p); err != nil {
			return err
		}
		d.Rev = cur.Rev
		rev, err = s.put(ctx, p.Rule, p.DB, d)
	}
	if err != nil {
		return fmt.Errorf("save checkpoint of rule %s in %s: %w", p.Rule, p.DB, err)
	}
	p.LastSeq, p.rev, p.Found, p.storedAt, p.docStale, p.trail = seq, rev, true, time.Now(), false, 0
	return s.cache(ctx, p)
}

// Begin stores p, a checkpoint not Found, at the beginning of its db's feed ("") — the _local
// doc and the cache entry — before its run reads anything of the db: a db deleted and created
// again meanwhile has lost the doc, so the run's first save finds it gone (ErrMoved) instead of
// creating a doc in the new db with the old db's seq. The checkpoint records the db's identity,
// which the first checkpoint to begin in a db creates (see IdentityID). Later Saves write the
// doc as after any other write of it (LocalEvery, LocalChanges): until then it says "from the
// beginning", so a cache lost meanwhile makes the rule act on those changes again (at least
// once), and a db deleted and created again meanwhile is told by the next run's Verify (the
// identity the entry names is gone). (Writing it again at the first Save cost every db of an
// initial sync one more request: 1 of on_change's 7.)
//
// The point Begin leaves is not Cached: like one Load read from CouchDB, it needs no Verify. Its
// run read the doc and the identity (Load) and wrote both itself; what Verify would read now is
// what the run just wrote, and a db deleted and created again from here on is told by the next
// run's Verify, as it is after any Save. (A first run of a db — every db of an initial sync —
// read them twice more for nothing: 2 of its 9 CouchDB requests.)
func (s *OnChangeStore) Begin(ctx context.Context, p *OnChangePoint) error {
	if err := s.save(ctx, p, "", true); err != nil {
		return err
	}
	p.cached = false
	return nil
}

// SaveNow is Save that writes the _local doc whatever LocalEvery says: for a checkpoint that
// must not be lost with the cache entry (one moved back to heal a change stream).
func (s *OnChangeStore) SaveNow(ctx context.Context, p *OnChangePoint, seq string) error {
	return s.save(ctx, p, seq, true)
}

// claim writes seq into the cache entry over the revision p holds (none: the entry must not
// exist) and makes the new revision p's token.
func (s *OnChangeStore) claim(ctx context.Context, p *OnChangePoint, seq string) error {
	if s.kv == nil {
		return nil
	}
	var rev uint64
	var err error
	if p.kvRev == 0 {
		rev, err = s.kv.Create(ctx, cacheKey(p.Rule, p.DB), p.entry(seq))
	} else {
		rev, err = s.kv.Update(ctx, cacheKey(p.Rule, p.DB), p.entry(seq), p.kvRev)
	}
	switch {
	case isCASFailure(err):
		return fmt.Errorf("save checkpoint of rule %s in %s: %w", p.Rule, p.DB, ErrFenced)
	case err != nil:
		return fmt.Errorf("save checkpoint of rule %s in %s: claim the cache entry: %w", p.Rule, p.DB, err)
	}
	p.kvRev = rev
	return nil
}

// stillHeld checks that the cache entry is still at p's token.
func (s *OnChangeStore) stillHeld(ctx context.Context, p *OnChangePoint) error {
	if s.kv == nil {
		return nil
	}
	e, err := s.kv.Get(ctx, cacheKey(p.Rule, p.DB))
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound) || err == nil && e.Revision() != p.kvRev:
		return fmt.Errorf("save checkpoint of rule %s in %s: %w", p.Rule, p.DB, ErrFenced)
	case err != nil:
		return fmt.Errorf("save checkpoint of rule %s in %s: check the cache entry: %w", p.Rule, p.DB, err)
	}
	return nil
}

// cache records the rev of p's _local doc in its entry, over the revision claim wrote.
func (s *OnChangeStore) cache(ctx context.Context, p *OnChangePoint) error {
	if s.kv == nil {
		p.cached = false
		return nil
	}
	rev, err := s.kv.Update(ctx, cacheKey(p.Rule, p.DB), p.entry(p.LastSeq), p.kvRev)
	switch {
	case isCASFailure(err):
		// Another holder claimed after this run did: its entry stands, and names its doc (a
		// doc this run wrote over it is rewritten by its next save, see Verify).
		return fmt.Errorf("save checkpoint of rule %s in %s: %w", p.Rule, p.DB, ErrFenced)
	case err != nil:
		return fmt.Errorf("save checkpoint of rule %s in %s: record it in the cache: %w", p.Rule, p.DB, err)
	}
	p.kvRev, p.cached = rev, true
	return nil
}

// isCASFailure reports whether err is a key-value write refused because the key is not at the
// expected revision.
func isCASFailure(err error) bool {
	var apiErr *jetstream.APIError
	return errors.Is(err, jetstream.ErrKeyExists) ||
		errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence
}

// newInstance returns a random lineage id.
func newInstance() string {
	var b [12]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// Reset sets the checkpoint of rule in db to seq ("" = the beginning) for `producer replay`,
// marking it as replayed (by s.ReplayID, if set). The cache entry is written first, whatever its revision: that moves
// the fencing token, so a run that read the checkpoint before — even one whose claim came
// before the reset and whose _local write lands after it — can no longer save (ErrFenced), and
// its late doc is rewritten from the entry by the next run (Verify). Then the _local doc, then
// the entry again with the doc's rev. Without a cache that answers, nothing is reset.
func (s *OnChangeStore) Reset(ctx context.Context, rule, db, seq string) error {
	cur, found, err := s.readDoc(ctx, rule, db)
	if err != nil {
		return fmt.Errorf("reset: %w", err)
	}
	p := OnChangePoint{Rule: rule, DB: db, LastSeq: seq, replayed: replayMark(time.Now().UTC().Format(time.RFC3339Nano), s.ReplayID), instance: cur.Instance, dbID: cur.DBID}
	if p.instance == "" {
		p.instance = newInstance()
	}
	if found {
		p.rev = cur.Rev
	}
	if s.kv != nil {
		if p.kvRev, err = s.kv.Put(ctx, cacheKey(rule, db), p.entry(seq)); err != nil {
			return fmt.Errorf("reset checkpoint of rule %s in %s: write the cache entry: %w", rule, db, err)
		}
	}
	d := localDoc{Rev: p.rev, Rule: rule, LastSeq: seq, ReplayedAt: p.replayed, Instance: p.instance, DBID: p.dbID, Fence: p.kvRev, UpdatedAt: time.Now().UTC()}
	for attempt := 0; ; attempt++ {
		p.rev, err = s.put(ctx, rule, db, d)
		if err == nil || attempt == 4 || !isConflict(err) && !errors.Is(err, couch.ErrNotFound) {
			break
		}
		// PouchDB Server: a holder fenced by the entry wrote the doc meanwhile; the reset wins.
		if cur, found, err = s.readDoc(ctx, rule, db); err != nil {
			return fmt.Errorf("reset: %w", err)
		}
		d.Rev = ""
		if found {
			d.Rev = cur.Rev
		}
	}
	if err != nil {
		return fmt.Errorf("reset checkpoint of rule %s in %s: %w", rule, db, err)
	}
	if s.kv != nil {
		_, err := s.kv.Update(ctx, cacheKey(rule, db), p.entry(seq), p.kvRev)
		if err != nil && !isCASFailure(err) { // refused: a run from the reset claimed it already
			return fmt.Errorf("reset checkpoint of rule %s in %s: record it in the cache: %w", rule, db, err)
		}
	}
	return nil
}

// Delete removes the checkpoint of rule in db, if any.
func (s *OnChangeStore) Delete(ctx context.Context, rule, db string) error {
	_, err := s.DeleteIfAny(ctx, rule, db)
	return err
}

// DeleteIfAny removes the checkpoint of rule in db and reports whether there was one.
func (s *OnChangeStore) DeleteIfAny(ctx context.Context, rule, db string) (bool, error) {
	s.Forget(ctx, rule, db)
	cur, found, err := s.readDoc(ctx, rule, db)
	if err != nil || !found {
		return false, err
	}
	err = s.couch.DoIdempotent(ctx, http.MethodDelete, localPath(s.couch, rule, db), map[string][]string{"rev": {cur.Rev}}, nil, nil)
	if err != nil && !errors.Is(err, couch.ErrNotFound) {
		return false, fmt.Errorf("delete checkpoint of rule %s in %s: %w", rule, db, err)
	}
	return true, nil
}

// Forget drops the cache entry of rule in db (best effort), whatever its revision: the next
// Load reads CouchDB, and a run that read the entry before is fenced. For a db that was deleted.
func (s *OnChangeStore) Forget(ctx context.Context, rule, db string) {
	if s.kv != nil {
		_ = s.kv.Purge(ctx, cacheKey(rule, db))
	}
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
	_, found, err := s.readDoc(ctx, d.Rule, d.DB)
	if err != nil || found {
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
