// Package rules turns rule documents of the spiegel database into compiled rules, matches them
// against database names and changed documents, and substitutes change values into webhook
// parameters and URLs (SPEC §2). It is pure: no I/O, no clock, no logging.
//
// JSON numbers: Parse decodes rule documents with json.Decoder.UseNumber, so numbers inside
// Params, selectors and `if` keep their exact text as json.Number. Every function that takes a
// decoded JSON value (Selector.Match, OnChange.MatchDoc, Substitute, QueryString) accepts numbers
// as json.Number, float64, int or int64, so documents decoded either way work.
package rules

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/mango"
)

// Rule kinds: the value of a rule document's "type" field.
const (
	KindReplicator = "replicator"
	KindOnChange   = "on_change"
)

// Ids of documents the service itself owns in the spiegel db; they are never rules.
const (
	CheckpointIDPrefix = "spiegel_cp_"
	ProducerSeqID      = "spiegel_producer_seq"
)

// ErrNotRule is returned by Parse for a document that is not a rule and must be ignored
// silently: design and local docs (ids starting with "_"), service-owned docs (CheckpointIDPrefix,
// ProducerSeqID), and docs without a string "type" or with a type other than KindReplicator and
// KindOnChange (for example the original Spiegel's "change_listener" and "global" docs).
var ErrNotRule = errors.New("not a rule document")

// ValidationError says why a rule document is invalid. Its text names the doc id and the field
// and never contains a password: URLs are never quoted in Reason.
type ValidationError struct {
	DocID  string
	Field  string // the top-level field at fault ("retry.delay_ms" for nested ones); "" for the whole doc
	Reason string
}

// Error returns `rule "<id>": field "<field>": <reason>` (or `rule "<id>": <reason>` when Field
// is empty).
func (e *ValidationError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("rule %q: %s", e.DocID, e.Reason)
	}
	return fmt.Sprintf("rule %q: field %q: %s", e.DocID, e.Field, e.Reason)
}

// Rule is a compiled, valid rule document. Implementations are immutable once returned by Parse
// and safe to share between goroutines.
type Rule interface {
	ID() string
	Rev() string
	Kind() string // KindReplicator or KindOnChange
	Enabled() bool
	// MatchesDB reports whether the rule applies to the database named db (ignores Enabled).
	MatchesDB(db string) bool
	// Group is the consumer group whose jobs the rule produces.
	Group() events.Group
}

// Parse compiles one document of the spiegel db. id is the doc id (when "" the doc's "_id" is
// used); raw is the doc's JSON. It returns ErrNotRule for documents that are not rules, a
// *ValidationError (match with errors.As) for invalid rule documents, else a *Replicator or an
// *OnChange. It checks subjects with the zero Policy (the default subject prefix, no operator
// list); ParseWith takes the installation's.
func Parse(id string, raw []byte) (Rule, error) { return ParseWith(id, raw, Policy{}) }

// ParseWith is Parse under the installation's policy p.
func ParseWith(id string, raw []byte, p Policy) (Rule, error) {
	if IsServiceDocID(id) {
		return nil, ErrNotRule
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, &ValidationError{DocID: id, Reason: "invalid JSON: " + jsonErrorText(err)}
	}
	if dec.More() {
		return nil, &ValidationError{DocID: id, Reason: "invalid JSON: trailing data after the document"}
	}
	doc, ok := v.(map[string]any)
	if !ok {
		return nil, &ValidationError{DocID: id, Reason: "document is not a JSON object"}
	}
	if id == "" {
		id, _ = doc["_id"].(string)
		if id == "" || IsServiceDocID(id) {
			return nil, ErrNotRule
		}
	}
	kind, _ := doc["type"].(string)
	f := fields{id: id, doc: doc}
	switch kind {
	case KindReplicator:
		return parseReplicator(f)
	case KindOnChange:
		return parseOnChange(f, p)
	default:
		return nil, ErrNotRule
	}
}

// IsServiceDocID reports whether id names a doc of the spiegel db that is never a rule: design
// and local docs, and the docs the service itself owns.
func IsServiceDocID(id string) bool {
	return strings.HasPrefix(id, "_") || strings.HasPrefix(id, CheckpointIDPrefix) || id == ProducerSeqID
}

// jsonErrorText describes a decoding error without quoting the input, which may hold a secret.
func jsonErrorText(err error) string {
	var syn *json.SyntaxError
	if errors.As(err, &syn) {
		return fmt.Sprintf("syntax error at byte offset %d", syn.Offset)
	}
	if errors.Is(err, io.EOF) {
		return "empty document"
	}
	return "cannot decode"
}

// fields reads typed values out of a decoded document, producing ValidationErrors that name the
// doc id and field.
type fields struct {
	id  string
	doc map[string]any
}

func (f fields) errorf(field, format string, args ...any) error {
	return &ValidationError{DocID: f.id, Field: field, Reason: fmt.Sprintf(format, args...)}
}

// present reports whether field is set to something other than null.
func (f fields) present(field string) bool {
	v, ok := f.doc[field]
	return ok && v != nil
}

// str returns a string field; absent or null gives "", another type an error.
func (f fields) str(field string) (string, error) {
	v, ok := f.doc[field]
	if !ok || v == nil {
		return "", nil
	}
	s, ok := v.(string)
	if !ok {
		return "", f.errorf(field, "must be a string, not %s", jsonTypeName(v))
	}
	return s, nil
}

// boolean returns a bool field; absent or null gives false.
func (f fields) boolean(field string) (bool, error) {
	v, ok := f.doc[field]
	if !ok || v == nil {
		return false, nil
	}
	b, ok := v.(bool)
	if !ok {
		return false, f.errorf(field, "must be true or false, not %s", jsonTypeName(v))
	}
	return b, nil
}

// millis reads a non-negative number of milliseconds; absent or null gives def.
func (f fields) millis(field string, def time.Duration) (time.Duration, error) {
	return millisValue(f, field, f.doc[field], def)
}

func millisValue(f fields, field string, v any, def time.Duration) (time.Duration, error) {
	if v == nil {
		return def, nil
	}
	n, ok := mango.Number(v)
	if !ok {
		return 0, f.errorf(field, "must be a number of milliseconds, not %s", jsonTypeName(v))
	}
	if n < 0 || math.IsNaN(n) || n > float64(math.MaxInt64/int64(time.Millisecond)) {
		return 0, f.errorf(field, "must be a non-negative number of milliseconds that fits in a duration")
	}
	return time.Duration(n * float64(time.Millisecond)), nil
}

// checkURL rejects a URL carrying a password. The reason never quotes the URL.
func (f fields) checkURL(field, s string) error {
	if hasPassword(s) {
		return f.errorf(field, "password in URL: put it in the passwords file")
	}
	return nil
}

// hasPassword reports whether s is a "scheme://" URL whose user info holds a password. It errs
// on the side of yes for ambiguous strings such as "http://u:pa/ss@host" (a password with '/').
func hasPassword(s string) bool {
	i := strings.Index(s, "://")
	if i < 0 {
		return false
	}
	rest := s[i+3:]
	at := strings.IndexByte(rest, '@')
	if at < 0 {
		return false
	}
	userinfo := rest[:at]
	if j := strings.IndexAny(userinfo, "/?#"); j >= 0 {
		// The '@' lies beyond the authority, unless the password itself holds '/', '?' or '#'.
		head := userinfo[:j]
		c := strings.IndexByte(head, ':')
		if c < 0 {
			return false
		}
		return !isPort(head[c+1:])
	}
	return strings.Contains(userinfo, ":")
}

func isPort(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// jsonTypeName names the JSON type of a decoded value, for error messages.
func jsonTypeName(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case string:
		return "a string"
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	default:
		if _, ok := mango.Number(v); ok {
			return "a number"
		}
		return fmt.Sprintf("%T", v)
	}
}
