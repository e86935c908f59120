package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchpath"
	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// ErrRuleNotFound is returned (wrapped, naming the id) by GetRule and DeleteRule for a rule doc
// that is not in the spiegel db.
var ErrRuleNotFound = errors.New("no such rule")

// RulesDB is the spiegel db, as the rules commands read and write it: over CouchDB alone (they
// need no NATS, so CI jobs that manage rules need no access to it).
type RulesDB struct {
	Couch *couch.Client
	Name  string
}

// OpenRulesDB connects to cfg's CouchDB, checking within cfg.AdminTimeout that it answers
// (ServerProblems otherwise, as Connect) and that the spiegel db exists.
func OpenRulesDB(ctx context.Context, cfg *config.Producer, log *logrus.Logger) (*RulesDB, error) {
	timeout := cfg.AdminTimeout
	if timeout <= 0 {
		timeout = defaultAdminTimeout
	}
	cc, err := producer.NewCouch(cfg, log)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if p := checkCouch(pctx, cc, cfg.CouchDBURL, timeout); p != "" {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, ServerProblems{p}
	}
	if _, err := cc.DBInfo(pctx, cfg.DBName); errors.Is(err, couch.ErrNotFound) {
		return nil, fmt.Errorf("the spiegel db %q does not exist: run `producer install` first", cfg.DBName)
	} else if err != nil {
		return nil, fmt.Errorf("look up the spiegel db %s: %w", cfg.DBName, err)
	}
	return &RulesDB{Couch: cc, Name: cfg.DBName}, nil
}

// docPath is the request path of doc id.
func (db *RulesDB) docPath(id string) string {
	return db.Couch.DBPath(db.Name) + "/" + couchpath.Segment(id)
}

// RuleSummary is one doc of the spiegel db as `producer rules list` shows it. URLs are shown
// without passwords (ShownURL).
type RuleSummary struct {
	ID      string `json:"id"`
	Kind    string `json:"kind"` // "replicator", "on_change", or the doc's other type ("" when none)
	Enabled bool   `json:"enabled"`
	DBName  string `json:"db_name,omitempty"`
	Source  string `json:"source,omitempty"`
	Target  string `json:"target,omitempty"`
	URL     string `json:"url,omitempty"`
	Subject string `json:"subject,omitempty"`
	Mirror  string `json:"mirror,omitempty"`
	Valid   bool   `json:"valid"`
	// Error says why the doc is not a valid rule (the consumers skip it), naming the field.
	Error string `json:"error,omitempty"`
}

// ListRules returns every doc of the spiegel db but design docs and the service's own docs
// (checkpoints, the producer's position), in id order, each checked with the consumers' parser
// under p.
func (db *RulesDB) ListRules(ctx context.Context, p rules.Policy) ([]RuleSummary, error) {
	out := []RuleSummary{}
	startKey := ""
	for {
		q := url.Values{"include_docs": {"true"}, "limit": {"500"}}
		if startKey != "" {
			q.Set("startkey", startKey)
			q.Set("skip", "1")
		}
		var page struct {
			Rows []struct {
				ID  string          `json:"id"`
				Doc json.RawMessage `json:"doc"`
			} `json:"rows"`
		}
		if err := db.Couch.DoIdempotent(ctx, http.MethodGet, db.Couch.DBPath(db.Name)+"/_all_docs", q, nil, &page); err != nil {
			return nil, fmt.Errorf("list the docs of %s: %w", db.Name, err)
		}
		for _, row := range page.Rows {
			if !rules.IsServiceDocID(row.ID) {
				out = append(out, summarize(row.ID, row.Doc, p))
			}
		}
		if len(page.Rows) < 500 {
			return out, nil
		}
		key, _ := json.Marshal(page.Rows[len(page.Rows)-1].ID)
		startKey = string(key)
	}
}

// summarize describes the stored doc raw of id.
func summarize(id string, raw json.RawMessage, p rules.Policy) RuleSummary {
	var doc map[string]any
	_ = json.Unmarshal(raw, &doc)
	str := func(k string) string { s, _ := doc[k].(string); return s }
	s := RuleSummary{ID: id, Kind: str("type"), DBName: str("db_name"),
		URL: ShownURL(str("url")), Subject: str("subject"), Mirror: str("mirror")}
	if s.Kind == rules.KindReplicator {
		s.Source, s.Target = ShownURL(str("source")), ShownURL(str("target"))
	}
	disabled, _ := doc["disabled"].(bool)
	s.Enabled = !disabled
	r, err := rules.ParseWith(id, raw, p)
	if err != nil {
		s.Error = problemOf("", id, doc, err).detail()
		return s
	}
	s.Valid, s.Enabled = true, r.Enabled()
	return s
}

// GetRule returns the stored doc of rule id (with its _rev), numbers as json.Number, every URL
// in it without a password (ShownURL). A missing doc is ErrRuleNotFound.
func (db *RulesDB) GetRule(ctx context.Context, id string) (map[string]any, error) {
	if err := checkRuleID(id); err != nil {
		return nil, err
	}
	var raw json.RawMessage
	if err := db.Couch.DoIdempotent(ctx, http.MethodGet, db.docPath(id), nil, nil, &raw); err != nil {
		if errors.Is(err, couch.ErrNotFound) {
			return nil, fmt.Errorf("rule %q: %w in the spiegel db %s", id, ErrRuleNotFound, db.Name)
		}
		return nil, fmt.Errorf("read rule %q: %w", id, err)
	}
	doc, err := decodeNumbers(raw)
	if err != nil {
		return nil, fmt.Errorf("read rule %q: %w", id, err)
	}
	redactURLs(doc)
	return doc, nil
}

// DeleteRule deletes rule id with its current revision (read first; a concurrent write is
// retried) and returns the revision of the deletion. A missing doc is ErrRuleNotFound.
func (db *RulesDB) DeleteRule(ctx context.Context, id string) (string, error) {
	if err := checkRuleID(id); err != nil {
		return "", err
	}
	for attempt := 1; attempt <= writeAttempts; attempt++ {
		var cur struct {
			Rev string `json:"_rev"`
		}
		if err := db.Couch.DoIdempotent(ctx, http.MethodGet, db.docPath(id), nil, nil, &cur); err != nil {
			if errors.Is(err, couch.ErrNotFound) {
				return "", fmt.Errorf("rule %q: %w in the spiegel db %s: nothing deleted", id, ErrRuleNotFound, db.Name)
			}
			return "", fmt.Errorf("read rule %q: %w", id, err)
		}
		var ans struct {
			Rev string `json:"rev"`
		}
		err := db.Couch.Do(ctx, http.MethodDelete, db.docPath(id), url.Values{"rev": {cur.Rev}}, nil, &ans)
		if err == nil {
			return ans.Rev, nil
		}
		if !isConflict(err) {
			return "", fmt.Errorf("delete rule %q: %w", id, err)
		}
		if err := pause(ctx, attempt); err != nil {
			return "", err
		}
	}
	return "", fmt.Errorf("delete rule %q: it changed %d times while being deleted; try again", id, writeAttempts)
}

// checkRuleID refuses ids that never name a rule: the rules commands leave the service's own
// docs and design docs alone.
func checkRuleID(id string) error {
	if id == "" {
		return errors.New("want a rule id")
	}
	if rules.IsServiceDocID(id) {
		return fmt.Errorf("%q is not a rule id: ids starting with _ or %s, and %s, are the service's own docs",
			id, rules.CheckpointIDPrefix, rules.ProducerSeqID)
	}
	return nil
}

// writeAttempts bounds how often a write that conflicts with a concurrent one is tried.
const writeAttempts = 5

// isConflict reports whether err is CouchDB's 409: the doc's revision moved since it was read.
func isConflict(err error) bool {
	var he *couch.HTTPError
	return errors.As(err, &he) && he.Status == http.StatusConflict
}

// pause waits a little before attempt+1 of a conflicting write (writers that collide are
// spread), or returns ctx's error.
func pause(ctx context.Context, attempt int) error {
	t := time.NewTimer(time.Duration(attempt*attempt) * 20 * time.Millisecond)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ShownURL is s for display: logging.RedactURL's result, and, when that still holds a ':'
// before the last '@' after "://" (a password holding '/', '?' or '#' defeats URL parsing), s
// with everything between "://" and that '@' replaced by "xxxxx". Strings without "://" are
// returned as they are.
func ShownURL(s string) string {
	r := logging.RedactURL(s)
	i := strings.Index(r, "://")
	if i < 0 {
		return r
	}
	rest := r[i+3:]
	at := strings.LastIndexByte(rest, '@')
	if at < 0 {
		return r
	}
	userinfo := rest[:at]
	user, pw, hasPW := strings.Cut(userinfo, ":")
	if !hasPW || pw == "xxxxx" && !strings.ContainsAny(user, "/?#") {
		return r
	}
	return r[:i+3] + "xxxxx@" + rest[at+1:]
}

// redactURLs replaces every string of v (a decoded JSON value) holding "://" by its ShownURL.
func redactURLs(v any) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if s, ok := e.(string); ok && strings.Contains(s, "://") {
				x[k] = ShownURL(s)
			} else {
				redactURLs(e)
			}
		}
	case []any:
		for i, e := range x {
			if s, ok := e.(string); ok && strings.Contains(s, "://") {
				x[i] = ShownURL(s)
			} else {
				redactURLs(e)
			}
		}
	}
}

// decodeNumbers decodes a JSON object keeping numbers as json.Number.
func decodeNumbers(raw []byte) (map[string]any, error) {
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.UseNumber()
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("decode: %s", jsonErrorText(err))
	}
	return doc, nil
}
