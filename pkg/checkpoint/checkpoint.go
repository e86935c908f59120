// Package checkpoint stores the service's positions (SPEC §2.4): the producer's feed position, a
// doc of the spiegel db, and the checkpoint of each (on_change rule, db), a _local doc in the
// watched db with a NATS key-value cache (OnChangeStore).
package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-kivik/kivik/v4"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// Doc ids of the service-owned docs.
const (
	// PrefixOnChange started the ids of on_change checkpoints in the spiegel db, where earlier
	// releases kept them (see OnChangeStore.MigrateLegacy).
	PrefixOnChange = "spiegel_cp_"
	// ProducerPositionID is the producer's feed position.
	ProducerPositionID = "spiegel_producer_seq"
)

// ID returns the doc id an earlier release gave the checkpoint of (rule, db) in the spiegel db:
// "spiegel_cp_<rule>_<db>" where '%' and '_' in the rule id are written %25 and %5F (see
// OnChangeStore.MigrateLegacy). The id itself contains '%': path-escape it in URLs.
func ID(rule, db string) string {
	r := strings.NewReplacer("%", "%25", "_", "%5F").Replace(rule)
	return PrefixOnChange + r + "_" + db
}

// Position is the producer's saved feed position.
type Position struct {
	LastSeq string `json:"last_seq"`
	// RulesSeq is the spiegel db seq up to which new and edited rules have had their existing
	// dbs enqueued; a restarted producer enqueues only for rules changed after it.
	RulesSeq  string    `json:"rules_seq,omitempty"`
	Source    string    `json:"source,omitempty"`
	UpdatedAt time.Time `json:"updated_at"`
}

// Store reads and writes service-owned docs in the spiegel db. Every request it makes ends
// after the client's request timeout (SPIEGEL_COUCHDB_TIMEOUT), whatever the caller's context.
type Store struct {
	db      *kivik.DB
	timeout time.Duration
	revs    sync.Map // doc id → rev of this store's last write
}

// NewStore returns a store over the spiegel db named db on c's server.
func NewStore(c *couch.Client, db string) *Store {
	return &Store{db: c.Kivik().DB(db), timeout: c.RequestTimeout()}
}

// ErrNotFound means the doc does not exist.
var ErrNotFound = errors.New("checkpoint not found")

// get reads id into out and returns its rev.
func (s *Store) get(ctx context.Context, id string, out any) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	row := s.db.Get(ctx, id)
	var raw json.RawMessage
	if err := row.ScanDoc(&raw); err != nil {
		if kivik.HTTPStatus(err) == http.StatusNotFound {
			return "", ErrNotFound
		}
		return "", fmt.Errorf("read %s: %w", id, err)
	}
	// The rev comes from the body: some servers quote the ETag kivik would read it from.
	var meta struct {
		Rev string `json:"_rev"`
	}
	if err := json.Unmarshal(raw, &meta); err != nil {
		return "", fmt.Errorf("read %s: %w", id, err)
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return "", fmt.Errorf("read %s: %w", id, err)
	}
	return meta.Rev, nil
}

// put writes doc as id, overwriting whatever is there (last writer wins: every writer's value is
// a safe position, see the producer and the onchange consumer). The rev of the last write is
// remembered, so a steady stream of saves costs one request each; a conflict (another writer, or
// no rev known yet) costs a read and a retry.
func (s *Store) put(ctx context.Context, id string, doc map[string]any) error {
	rev, _ := s.revs.Load(id)
	for attempt := 0; attempt < 5; attempt++ {
		if r, _ := rev.(string); r != "" {
			doc["_rev"] = r
		} else {
			delete(doc, "_rev")
		}
		newRev, err := s.putOnce(ctx, id, doc)
		if err == nil {
			s.revs.Store(id, newRev)
			return nil
		}
		if kivik.HTTPStatus(err) != http.StatusConflict {
			return fmt.Errorf("write %s: %w", id, err)
		}
		var cur map[string]any
		r, gerr := s.get(ctx, id, &cur)
		if gerr != nil && !errors.Is(gerr, ErrNotFound) {
			return gerr
		}
		rev = r
	}
	return fmt.Errorf("write %s: conflicts persisted after 5 attempts", id)
}

func (s *Store) putOnce(ctx context.Context, id string, doc map[string]any) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	return s.db.Put(ctx, id, doc)
}

// Position reads the producer's position; ErrNotFound when none was saved.
func (s *Store) Position(ctx context.Context) (Position, error) {
	var p Position
	_, err := s.get(ctx, ProducerPositionID, &p)
	return p, err
}

// SavePosition writes the producer's position.
func (s *Store) SavePosition(ctx context.Context, p Position) error {
	p.UpdatedAt = time.Now().UTC()
	return s.put(ctx, ProducerPositionID, map[string]any{"last_seq": p.LastSeq, "rules_seq": p.RulesSeq, "source": p.Source, "updated_at": p.UpdatedAt})
}
