// Package webhook sends the HTTP requests of on_change rules (SPEC §2.2, §2.3, §5.3). Build turns
// a rule and the values of one change into a Request; a Client sends it with the password of the
// URL's user injected at send time, a timestamp, a delivery id and an optional HMAC signature
// (package signature: the v1 scheme over the whole request, the Standard Webhooks scheme over id,
// timestamp and body, or both, as the rule's "signing" says), the host allow-list and the address check on
// every connection (closed by default to non-public addresses), a timeout and the rule's redirect
// policy, and classifies the answer; Deliver retries it with the rule's backoff.
//
// The package knows nothing about batches, checkpoints or NATS: the on_change consumer decides
// what a failed or given-up request means for its checkpoint.
//
// No error, log line or metric of this package ever holds a password: a Request's URL never
// carries one (rules may not), the injected URL never leaves Client.Send, and error texts are
// built from the URL without password and redacted once more.
package webhook

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// Request is one webhook call, ready to send. It is a plain value: build it once, send it any
// number of times.
type Request struct {
	Method string // GET, POST, PUT, PATCH or DELETE
	// URL is the final URL: tokens interpolated (URL-escaped) and, for GET and DELETE, the params
	// appended as a query string. It carries a user name at most, never a password.
	URL string
	// Body is the JSON-encoded params for POST, PUT and PATCH; nil for GET and DELETE and when
	// the rule has no params.
	Body []byte
	// Header holds the rule's headers (Content-Type is added for a body).
	Header http.Header
	// Timeout bounds each attempt; 0 means the Client's default.
	Timeout time.Duration
	// Delivery is the X-Spiegel-Delivery id, the same for every attempt. Build derives it from
	// the rule, the db, the change (doc id and rev) and the request itself, so that a retry after
	// a restart or a redelivered job has it too; "" means one derived from Key.
	Delivery string
	// FollowRedirects is the rule's "follow_redirects": a 3xx answer is followed (to allowed
	// hosts only) instead of being a failure.
	FollowRedirects bool
	// Signing is the rule's "signing": which header sets every attempt carries (see
	// Client.Send): rules.SigningV1 ("" means it too), rules.SigningStandard or rules.SigningBoth.
	Signing string
}

// ErrBadRequest marks a request that cannot be built or sent as written (its URL does not parse,
// its params cannot be encoded): retrying cannot fix it.
var ErrBadRequest = errors.New("webhook: bad request")

// Build returns the request rule makes for one change. URL tokens are interpolated with
// URL-escaping; params are substituted keeping JSON types (rules.Substitute) and sent as a
// bracket-notation query string for GET and DELETE (rules.QueryString), else as a JSON body.
// The rule's timeout is copied unless it is the rules default (then the Client's default
// applies, so SPIEGEL_WEBHOOK_TIMEOUT is honoured for rules that name none). Errors wrap
// ErrBadRequest.
func Build(rule *rules.OnChange, vars rules.Vars) (Request, error) {
	req := Request{Method: rule.Method, Header: http.Header{}, FollowRedirects: rule.FollowRedirects, Signing: rule.Signing}
	if req.Method == "" {
		req.Method = http.MethodGet
	}
	if rule.Timeout != rules.DefaultTimeout {
		req.Timeout = rule.Timeout
	}
	for k, v := range rule.Headers {
		req.Header.Set(k, v)
	}
	u, err := url.Parse(rules.Interpolate(rule.URL, vars, true))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return Request{}, fmt.Errorf("%w: rule %s: the URL is not an absolute http(s) URL once interpolated", ErrBadRequest, rule.ID())
	}
	u.Fragment, u.RawFragment = "", ""
	params := rules.Substitute(rule.Params, vars)
	switch req.Method {
	case http.MethodGet, http.MethodDelete:
		if qs := rules.QueryString(params); qs != "" {
			if u.RawQuery != "" {
				u.RawQuery += "&" + qs
			} else {
				u.RawQuery = qs
			}
		}
	default:
		if params != nil {
			if req.Body, err = json.Marshal(params); err != nil {
				return Request{}, fmt.Errorf("%w: rule %s: encode params: %v", ErrBadRequest, rule.ID(), err)
			}
			req.Header.Set("Content-Type", "application/json")
		}
	}
	req.URL = u.String()
	req.Delivery = deliveryID(rule.ID(), vars.DBName, vars.ChangeID, vars.ChangeRev, req.Key())
	return req, nil
}

// deliveryID hashes its parts (length-prefixed, so that no two lists give the same input) into
// 32 hex digits. The change's seq is left out on purpose: CouchDB 3 may list the same change
// under another seq when a feed is read again from an earlier point.
func deliveryID(parts ...string) string {
	h := sha256.New()
	h.Write([]byte("spiegel-delivery-v1"))
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// delivery is r's delivery id: Delivery, or one derived from Key.
func (r Request) delivery() string {
	if r.Delivery != "" {
		return r.Delivery
	}
	return deliveryID(r.Key())
}

// Key identifies the request for debouncing: identical method, final URL and body give the same
// key (headers do not count: they come from the rule and are the same for every change).
func (r Request) Key() string {
	var b strings.Builder
	b.Grow(len(r.Method) + len(r.URL) + len(r.Body) + 2)
	b.WriteString(r.Method)
	b.WriteByte(' ')
	b.WriteString(r.URL)
	b.WriteByte('\n')
	b.Write(r.Body)
	return b.String()
}
