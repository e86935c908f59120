package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchpath"
)

// IdentityID is the id, after "_local/", of a watched db's identity doc: a random id written the
// first time an on_change checkpoint begins in the db (or an earlier release's checkpoint is
// next saved), recorded in every checkpoint of the db, read by every verification. It tells a
// db from another of the same name — a db deleted and created again — without reading seqs:
// nothing but its first writer puts it in a db, so it dies with the db, and a checkpoint write
// of the old db that lands in the new one (CouchDB 3 takes _local docs whatever their rev)
// cannot bring it along. GET /{db} has nothing else that would: CouchDB 3 and PouchDB Server
// answer the same instance_start_time for a db created again.
const IdentityID = "spiegel_db"

// identityDoc is the body of a db's identity doc.
type identityDoc struct {
	ID        string    `json:"id"`
	CreatedAt time.Time `json:"created_at,omitzero"`
}

// identities shares the identity requests of one db between the checkpoints (the rules) of one
// job, which run at the same time: concurrent readers of a db's identity share one GET, and
// concurrent creators one GET-then-PUT, so that two rules beginning at once in a new db record
// the same id even on CouchDB 3, where a second PUT without a rev overwrites the first.
type identities struct {
	mu      sync.Mutex
	flights map[string]*identityFlight // "read:"/"ensure:" + db → the request under way
	made    map[string]madeIdentity    // db → the identity this process created there lately
	// noLocalDocs: the server has no POST /{db}/_local_docs (readBoth)
	noLocalDocs atomic.Bool
}

// madeIdentity is an identity this process created, and when.
type madeIdentity struct {
	id string
	at time.Time
}

// madeKeep is how long the identities this process created are remembered (identities.made): for
// a rule of the same job that read the db's identity missing before another rule created it, and
// asks to create it after that creation ended (an overlapping ask shares the creation). Only an
// identity created after the asker's read is taken: one created before it, which that read did
// not see, was of an earlier db of the name.
const madeKeep = time.Minute

// remember records id as created in db now, forgetting the identities older than madeKeep once
// there are many.
func (ids *identities) remember(db, id string) {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	if ids.made == nil {
		ids.made = map[string]madeIdentity{}
	}
	now := time.Now()
	if len(ids.made) >= 1024 {
		for k, m := range ids.made {
			if now.Sub(m.at) > madeKeep {
				delete(ids.made, k)
			}
		}
	}
	ids.made[db] = madeIdentity{id, now}
}

// madeSince returns the identity this process created in db after since, less than madeKeep
// ago ("": none).
func (ids *identities) madeSince(db string, since time.Time) string {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	if m, ok := ids.made[db]; ok && m.at.After(since) && time.Since(m.at) <= madeKeep {
		return m.id
	}
	return ""
}

type identityFlight struct {
	done chan struct{}
	id   string
	err  error
}

// share runs fn for key, or waits for the run of fn under way for key. fn runs without the
// caller's cancellation (its requests end at the client's request timeout), so that one caller
// giving up does not fail the others; each caller stops waiting when its own ctx ends.
func (ids *identities) share(ctx context.Context, key string, fn func(context.Context) (string, error)) (string, error) {
	ids.mu.Lock()
	f, ok := ids.flights[key]
	if !ok {
		if ids.flights == nil {
			ids.flights = map[string]*identityFlight{}
		}
		f = &identityFlight{done: make(chan struct{})}
		ids.flights[key] = f
		go func() {
			f.id, f.err = fn(context.WithoutCancel(ctx))
			ids.mu.Lock()
			delete(ids.flights, key)
			ids.mu.Unlock()
			close(f.done)
		}()
	}
	ids.mu.Unlock()
	select {
	case <-f.done:
		return f.id, f.err
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// readIdentity returns db's identity ("" when the db has none, or does not exist).
func (s *OnChangeStore) readIdentity(ctx context.Context, db string) (string, error) {
	return s.ids.share(ctx, "read:"+db, func(ctx context.Context) (string, error) {
		return s.getIdentity(ctx, db)
	})
}

// ensureIdentity returns db's identity, creating it when the db has none: a PUT without a rev,
// which PouchDB Server refuses (409) when another writer created it first — then that one is
// read. CouchDB 3 takes the PUT whatever is there: only the creators within this process are
// kept from racing (identities); a holder whose lease expired and that creates the identity of
// a new db at the same moment as the db's current job can leave that job's checkpoints naming
// an id the db no longer has, and its next run starts over (a spurious start over, never a
// missed one).
//
// noneAt, when not zero, is when the caller read the identity missing (Load, Verify): the
// identity is then created without reading it once more — unless this process created one in
// db since (another rule of the same job did), which is taken. That spares every db of an
// initial sync one request (1 of on_change's 6); the window it leaves to another creator is
// the one a read before the PUT leaves on CouchDB 3 anyway, only longer by the caller's work
// between the two.
func (s *OnChangeStore) ensureIdentity(ctx context.Context, db string, noneAt time.Time) (string, error) {
	return s.ids.share(ctx, "ensure:"+db, func(ctx context.Context) (string, error) {
		if noneAt.IsZero() {
			if id, err := s.getIdentity(ctx, db); err != nil || id != "" {
				return id, err
			}
		} else if id := s.ids.madeSince(db, noneAt); id != "" {
			return id, nil
		}
		d := identityDoc{ID: newInstance(), CreatedAt: time.Now().UTC()}
		err := s.couch.DoIdempotent(ctx, http.MethodPut, identityPath(s.couch, db), nil, d, nil)
		switch {
		case isConflict(err):
			return s.getIdentity(ctx, db)
		case err != nil:
			return "", fmt.Errorf("create the identity of %s: %w", db, err)
		}
		s.ids.remember(db, d.ID)
		return d.ID, nil
	})
}

func (s *OnChangeStore) getIdentity(ctx context.Context, db string) (string, error) {
	var d identityDoc
	err := s.couch.DoIdempotent(ctx, http.MethodGet, identityPath(s.couch, db), nil, nil, &d)
	switch {
	case errors.Is(err, couch.ErrNotFound):
		return "", nil
	case err != nil:
		return "", fmt.Errorf("read the identity of %s: %w", db, err)
	}
	return d.ID, nil
}

// readWithIdentity reads the _local doc of rule in db and db's identity: with one request where
// the server has POST /{db}/_local_docs (readBoth), else two in parallel.
func (s *OnChangeStore) readWithIdentity(ctx context.Context, rule, db string) (d localDoc, found bool, dbID string, err error) {
	if !s.ids.noLocalDocs.Load() {
		if d, found, dbID, ok, err := s.readBoth(ctx, rule, db); ok {
			return d, found, dbID, err
		}
	}
	type identity struct {
		id  string
		err error
	}
	ch := make(chan identity, 1)
	go func() {
		id, err := s.readIdentity(ctx, db)
		ch <- identity{id, err}
	}()
	d, found, err = s.readDoc(ctx, rule, db)
	ident := <-ch
	if err != nil {
		return d, found, "", err
	}
	if ident.err != nil {
		return d, found, "", ident.err
	}
	return d, found, ident.id, nil
}

// readBoth reads the _local doc of rule in db and db's identity with one request,
// POST /{db}/_local_docs with both keys (CouchDB 2+): each job verifies its cached checkpoints
// with it, and two GETs cost CouchDB's CPU about twice one request's (on_change dispatch over
// 100 dbs of 20 changes: some 2 ms a job). ok false: the server has no such endpoint (PouchDB
// Server answers 400; this store then reads with GETs from now on) or answered 404 for another
// reason than a missing db; the caller reads with GETs. A missing db is found false, no identity.
func (s *OnChangeStore) readBoth(ctx context.Context, rule, db string) (d localDoc, found bool, dbID string, ok bool, err error) {
	cpKey, idKey := "_local/"+LocalPrefix+rule, "_local/"+IdentityID
	var ans struct {
		Rows []struct {
			Key   string          `json:"key"`
			Error string          `json:"error"`
			Doc   json.RawMessage `json:"doc"`
		} `json:"rows"`
	}
	err = s.couch.DoIdempotent(ctx, http.MethodPost, s.couch.DBPath(db)+"/_local_docs", url.Values{"include_docs": {"true"}},
		map[string][]string{"keys": {cpKey, idKey}}, &ans)
	var he *couch.HTTPError
	switch {
	case errors.As(err, &he) && he.DBMissing():
		return localDoc{}, false, "", true, nil
	case errors.As(err, &he) && (he.Status == http.StatusBadRequest || he.Status == http.StatusMethodNotAllowed):
		s.ids.noLocalDocs.Store(true)
		return localDoc{}, false, "", false, nil
	case errors.As(err, &he) && he.Status == http.StatusNotFound:
		return localDoc{}, false, "", false, nil
	case err != nil:
		return localDoc{}, false, "", true, fmt.Errorf("read checkpoint of rule %s in %s and the db's identity: %w", rule, db, err)
	}
	for _, r := range ans.Rows {
		if r.Error != "" || len(r.Doc) == 0 || string(r.Doc) == "null" {
			continue // not_found
		}
		switch r.Key {
		case cpKey:
			if err := json.Unmarshal(r.Doc, &d); err != nil {
				return localDoc{}, false, "", true, fmt.Errorf("read checkpoint of rule %s in %s: %w", rule, db, err)
			}
			found = true
		case idKey:
			var id identityDoc
			if err := json.Unmarshal(r.Doc, &id); err != nil {
				return localDoc{}, false, "", true, fmt.Errorf("read the identity of %s: %w", db, err)
			}
			dbID = id.ID
		}
	}
	return d, found, dbID, true, nil
}

// identityPath is the request path of db's identity doc.
func identityPath(c *couch.Client, db string) string {
	return c.DBPath(db) + "/_local/" + couchpath.Segment(IdentityID)
}
