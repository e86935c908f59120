package rules

import (
	"encoding/json"
	"net/url"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/mango"
)

// Where a new on_change rule starts reading a db that has no checkpoint yet (the "since" field).
const (
	SinceBeginning = "beginning"
	SinceNow       = "now"
)

// How an on_change rule's webhook requests are signed (the "signing" field), with the secrets
// the operator configures (SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES; see package webhook).
const (
	// SigningV1 (the default) sends X-Spiegel-Timestamp, X-Spiegel-Delivery and
	// X-Spiegel-Signature: v1=<hex> (package webhook/signature).
	SigningV1 = "v1"
	// SigningStandard sends the Standard Webhooks headers webhook-id, webhook-timestamp and
	// webhook-signature: v1,<base64> (https://www.standardwebhooks.com/).
	SigningStandard = "standard"
	// SigningBoth sends both header sets.
	SigningBoth = "both"
)

// DefaultTimeout is the per-request timeout of an on_change rule without "timeout_ms".
const DefaultTimeout = 30 * time.Second

// OnChange is a compiled `on_change` rule (SPEC §2.2). Exactly one of URL, Subject and Mirror
// is set.
type OnChange struct {
	id, rev string
	// DBPattern selects the dbs (unanchored RE2); nil means every db.
	DBPattern *regexp.Regexp
	// If maps top-level doc fields to regexes that must all match (see MatchDoc); a nil regex
	// means the field must be absent or null.
	If       map[string]*regexp.Regexp
	Selector *mango.Selector // nil: no selector
	// URL is the webhook template as written (may hold ${db_name}, ${change.id}, ...; see
	// Interpolate with urlEscape=true).
	URL     string
	Method  string            // upper case: GET (default), POST, PUT, PATCH or DELETE
	Params  any               // JSON value (numbers as json.Number), nil when absent; see Substitute
	Headers map[string]string // nil when absent
	// Block makes the consumer wait for each request before the next change (default false).
	Block bool
	// Debounce sends identical requests (method, final URL, body) once per batch.
	Debounce bool
	// FollowRedirects, field "follow_redirects" (default false), follows 3xx answers, to allowed
	// hosts only; without it a 3xx answer is a failed request.
	FollowRedirects bool
	// Subject, instead of URL, publishes the change to NATS; it may hold ${db_name}.
	Subject string
	// Mirror, instead of URL and Subject, names the NATS KV bucket that keeps the winning
	// revision of every matching doc (key mirrorkey.Encode(db, doc id); a deleted doc is a KV
	// delete).
	Mirror   string
	Since    string // SinceBeginning (default) or SinceNow
	Disabled bool
	// Timeout bounds each request: field "timeout_ms" (a positive number of milliseconds),
	// default DefaultTimeout.
	Timeout time.Duration
	Retry   RetryPolicy // field "retry"; see RetryPolicy
	// Signing, field "signing", is how the webhook requests are signed: SigningV1 (default),
	// SigningStandard or SigningBoth. Subject and mirror rules ignore it.
	Signing string
}

// ID returns the doc id.
func (r *OnChange) ID() string { return r.id }

// Rev returns the doc revision the rule was parsed from ("" if the doc had none).
func (r *OnChange) Rev() string { return r.rev }

// Kind returns KindOnChange.
func (r *OnChange) Kind() string { return KindOnChange }

// Enabled reports whether the rule is not disabled.
func (r *OnChange) Enabled() bool { return !r.Disabled }

// Group returns events.GroupOnChange.
func (r *OnChange) Group() events.Group { return events.GroupOnChange }

// MatchesDB reports whether the rule applies to db.
func (r *OnChange) MatchesDB(db string) bool {
	return r.DBPattern == nil || r.DBPattern.MatchString(db)
}

// MatchDoc reports whether a changed doc passes the rule's `if` and selector. Every `if` entry
// must hold: a regex is tested (unanchored) against the top-level field rendered as text
// (strings as they are, other values as JSON text); it fails on an absent or null field. A nil
// entry holds when the field is absent or null. A nil doc is treated as an empty one.
func (r *OnChange) MatchDoc(doc map[string]any) bool {
	for field, re := range r.If {
		v := doc[field]
		if re == nil {
			if v != nil {
				return false
			}
			continue
		}
		if v == nil || !re.MatchString(fieldText(v)) {
			return false
		}
	}
	return r.Selector == nil || r.Selector.Match(doc)
}

// fieldText renders a JSON value as text: strings as they are, anything else as JSON.
func fieldText(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	if n, ok := v.(json.Number); ok {
		return string(n)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(b)
}

func parseOnChange(f fields, p Policy) (*OnChange, error) {
	r := &OnChange{id: f.id, Timeout: DefaultTimeout}
	r.rev, _ = f.doc["_rev"].(string)
	var err error
	if f.present("db_name") {
		src, err := f.str("db_name")
		if err != nil {
			return nil, err
		}
		if r.DBPattern, err = regexp.Compile(src); err != nil {
			return nil, f.errorf("db_name", "invalid regular expression (RE2 syntax): %v", err)
		}
	}
	if r.If, err = parseIf(f); err != nil {
		return nil, err
	}
	if f.present("selector") {
		sel, ok := f.doc["selector"].(map[string]any)
		if !ok {
			return nil, f.errorf("selector", "must be an object (a Mango selector)")
		}
		if r.Selector, err = mango.Compile(sel); err != nil {
			return nil, f.errorf("selector", "%v", err)
		}
	}
	if r.URL, err = f.str("url"); err != nil {
		return nil, err
	}
	if r.Subject, err = f.str("subject"); err != nil {
		return nil, err
	}
	if r.Mirror, err = f.str("mirror"); err != nil {
		return nil, err
	}
	switch {
	case r.URL == "" && r.Subject == "" && r.Mirror == "":
		return nil, f.errorf("url", "one of url, subject and mirror is required")
	case r.URL != "" && r.Subject != "":
		return nil, f.errorf("subject", "only one of url, subject and mirror may be set (two rules do both)")
	case r.Mirror != "" && (r.URL != "" || r.Subject != ""):
		return nil, f.errorf("mirror", "only one of url, subject and mirror may be set (two rules do both)")
	case r.Mirror != "":
		if !validBucket(r.Mirror) {
			return nil, f.errorf("mirror", "%q is not a NATS KV bucket name (letters, digits, '-' and '_')", r.Mirror)
		}
	case r.URL != "":
		if err := checkWebhookURL(f, r.URL); err != nil {
			return nil, err
		}
	default:
		if err := checkSubject(r.Subject); err != nil {
			return nil, f.errorf("subject", "%v", err)
		}
		if err := p.checkSubjectSpace(r.Subject); err != nil {
			return nil, f.errorf("subject", "%v", err)
		}
	}
	if r.Method, err = f.str("method"); err != nil {
		return nil, err
	}
	r.Method = strings.ToUpper(r.Method)
	switch r.Method {
	case "":
		r.Method = "GET"
	case "GET", "POST", "PUT", "PATCH", "DELETE":
	default:
		return nil, f.errorf("method", "must be GET, POST, PUT, PATCH or DELETE")
	}
	r.Params = f.doc["params"]
	if r.Headers, err = parseHeaders(f); err != nil {
		return nil, err
	}
	if r.Block, err = f.boolean("block"); err != nil {
		return nil, err
	}
	if r.Debounce, err = f.boolean("debounce"); err != nil {
		return nil, err
	}
	if r.FollowRedirects, err = f.boolean("follow_redirects"); err != nil {
		return nil, err
	}
	if r.Disabled, err = f.boolean("disabled"); err != nil {
		return nil, err
	}
	if r.Since, err = f.str("since"); err != nil {
		return nil, err
	}
	switch r.Since {
	case "":
		r.Since = SinceBeginning
	case SinceBeginning, SinceNow:
	default:
		return nil, f.errorf("since", "must be %q or %q", SinceBeginning, SinceNow)
	}
	if r.Signing, err = parseSigning(f); err != nil {
		return nil, err
	}
	if r.Timeout, err = f.millis("timeout_ms", DefaultTimeout); err != nil {
		return nil, err
	}
	if r.Timeout <= 0 {
		return nil, f.errorf("timeout_ms", "must be positive")
	}
	if r.Retry, err = parseRetry(f); err != nil {
		return nil, err
	}
	return r, nil
}

// parseSigning reads "signing": absent, null or "" gives SigningV1.
func parseSigning(f fields) (string, error) {
	s, err := f.str("signing")
	if err != nil {
		return "", err
	}
	switch s {
	case "":
		return SigningV1, nil
	case SigningV1, SigningStandard, SigningBoth:
		return s, nil
	default:
		return "", f.errorf("signing", "must be %q, %q or %q", SigningV1, SigningStandard, SigningBoth)
	}
}

func parseIf(f fields) (map[string]*regexp.Regexp, error) {
	v, ok := f.doc["if"]
	if !ok || v == nil {
		return nil, nil
	}
	obj, ok := v.(map[string]any)
	if !ok {
		return nil, f.errorf("if", "must be an object of field → regex (or null)")
	}
	out := make(map[string]*regexp.Regexp, len(obj))
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys) // report the first bad entry deterministically
	for _, k := range keys {
		switch x := obj[k].(type) {
		case nil:
			out[k] = nil
		case string:
			re, err := regexp.Compile(x)
			if err != nil {
				return nil, f.errorf("if", "entry %q: invalid regular expression (RE2 syntax): %v", k, err)
			}
			out[k] = re
		default:
			return nil, f.errorf("if", "entry %q: must be a regex string or null, not %s", k, jsonTypeName(x))
		}
	}
	return out, nil
}

func parseHeaders(f fields) (map[string]string, error) {
	v, ok := f.doc["headers"]
	if !ok || v == nil {
		return nil, nil
	}
	obj, ok := v.(map[string]any)
	if !ok {
		return nil, f.errorf("headers", "must be an object of header name → string")
	}
	out := make(map[string]string, len(obj))
	for k, hv := range obj {
		s, ok := hv.(string)
		if !ok {
			return nil, f.errorf("headers", "header %q: value must be a string", k)
		}
		if !isToken(k) {
			return nil, f.errorf("headers", "header %q: invalid header name", k)
		}
		if strings.ContainsAny(s, "\r\n\x00") {
			return nil, f.errorf("headers", "header %q: value holds a line break or NUL", k)
		}
		out[k] = s
	}
	return out, nil
}

// isToken reports whether s is a valid HTTP header name (RFC 9110 token).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
		if !ok {
			return false
		}
	}
	return true
}

func checkWebhookURL(f fields, raw string) error {
	if err := f.checkURL("url", raw); err != nil {
		return err
	}
	// Tokens may sit anywhere, even in the host: check the URL with placeholders.
	u, err := url.Parse(placeholderRE(raw))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return f.errorf("url", "must be an absolute http or https URL")
	}
	return nil
}

// placeholderRE replaces substitution tokens by a plain letter, for syntax checks of templates.
func placeholderRE(s string) string {
	if !strings.Contains(s, "$") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		if _, n, ok := matchToken(s, i, true); ok {
			b.WriteByte('x')
			i += n
			continue
		}
		b.WriteByte(s[i])
		i++
	}
	return b.String()
}

// validBucket reports whether s is a valid NATS KV bucket name.
func validBucket(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// checkSubject validates a NATS publish subject that may hold substitution tokens (each standing
// for what will be one token).
func checkSubject(subject string) error {
	s := placeholderRE(subject)
	if strings.ContainsAny(s, " \t\r\n\x00") {
		return errString("not a valid NATS subject: holds whitespace")
	}
	if strings.ContainsAny(s, "*>") {
		return errString("not a valid NATS subject: wildcards are not allowed")
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" {
			return errString("not a valid NATS subject: empty token")
		}
	}
	return nil
}
