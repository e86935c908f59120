// Package signature signs and verifies the requests of Spiegel's webhooks. Receivers import it
// to check that a request comes from their Spiegel installation, was made for them (method,
// path and query) and is fresh; it depends on the standard library only.
//
// Every webhook request carries three headers:
//
//	X-Spiegel-Timestamp: 1767225600            (unix seconds when the attempt was sent)
//	X-Spiegel-Delivery:  3f9c0b7e5d1a4c2b8e6f0a9d7c5b3e1f (the same for every retry of a request)
//	X-Spiegel-Signature: v1=<hex>[,v1=<hex>...] (one value per configured secret)
//
// Each v1 value is the lower-case hex HMAC-SHA256, keyed with one secret, of
//
//	<timestamp> "\n" <METHOD> "\n" <path?query> "\n" <delivery id> "\n" <body>
//
// where <path?query> is the request target exactly as sent on the request line (for example
// "/hook/db1?id=doc%2F1"), <METHOD> is upper case and <body> is the raw body (empty for GET and
// DELETE). While a secret is rotated the sender signs with the new and the old secret; a receiver
// accepts a request when any value matches any secret it knows. Verify also refuses timestamps
// further than a tolerance from its clock, so that a captured request cannot be replayed later;
// within the tolerance, receivers that must not act twice deduplicate by delivery id.
//
// A rule may ask for the Standard Webhooks scheme instead of this one, or for both (its
// "signing" field): SignStandard makes the webhook-signature header of that scheme, which any
// Standard Webhooks library verifies (see standard.go).
package signature

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// The headers of a signed request.
const (
	TimestampHeader = "X-Spiegel-Timestamp"
	DeliveryHeader  = "X-Spiegel-Delivery"
	SignatureHeader = "X-Spiegel-Signature"
)

// Scheme is the version tag of the signatures this package makes ("v1=<hex>").
const Scheme = "v1"

// DefaultTolerance is how far a request's timestamp may be from the receiver's clock when the
// Verifier names no tolerance.
const DefaultTolerance = 5 * time.Minute

// maxValues bounds the signature values Verify compares, so that a header stuffed with values
// costs little.
const maxValues = 16

// Errors of Verify. None of them quotes a secret or a signature.
var (
	// ErrMissing: a header is missing, empty or malformed.
	ErrMissing = errors.New("signature: missing or malformed X-Spiegel-Timestamp, X-Spiegel-Delivery or X-Spiegel-Signature")
	// ErrExpired: the timestamp is further than the tolerance from the receiver's clock.
	ErrExpired = errors.New("signature: timestamp outside the tolerance")
	// ErrMismatch: no v1 value matches any secret.
	ErrMismatch = errors.New("signature: no signature matches")
	// ErrNoSecret: the Verifier has no secret.
	ErrNoSecret = errors.New("signature: no secret to verify with")
)

// Message returns the signed string of a request (see the package comment).
func Message(timestamp int64, method, target, delivery string, body []byte) []byte {
	ts := strconv.FormatInt(timestamp, 10)
	b := make([]byte, 0, len(ts)+len(method)+len(target)+len(delivery)+len(body)+4)
	b = append(b, ts...)
	b = append(b, '\n')
	b = append(b, method...)
	b = append(b, '\n')
	b = append(b, target...)
	b = append(b, '\n')
	b = append(b, delivery...)
	b = append(b, '\n')
	return append(b, body...)
}

func mac(secret, msg []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write(msg)
	return m.Sum(nil)
}

// Sign returns the X-Spiegel-Signature value of a request: "v1=<hex>" for each secret, in order,
// joined by commas. It returns "" when secrets is empty.
func Sign(secrets [][]byte, timestamp int64, method, target, delivery string, body []byte) string {
	msg := Message(timestamp, method, target, delivery, body)
	vals := make([]string, 0, len(secrets))
	for _, s := range secrets {
		vals = append(vals, Scheme+"="+hex.EncodeToString(mac(s, msg)))
	}
	return strings.Join(vals, ",")
}

// Verifier checks signed requests. The zero value has no secret and refuses everything.
type Verifier struct {
	// Secrets are the keys to accept: during a rotation the new and the old one.
	Secrets [][]byte
	// Tolerance is the largest accepted difference between a request's timestamp and Now, either
	// way (clock skew plus delivery time); 0 means DefaultTolerance.
	Tolerance time.Duration
	// Now is the receiver's clock; nil means time.Now.
	Now func() time.Time
}

// Verify checks r, whose body the caller has read into body (the raw bytes, before any
// decoding), against the secrets: it returns nil when the timestamp is within the tolerance and
// some v1 value of X-Spiegel-Signature is the HMAC of the request under some secret. The request
// target is r.RequestURI as the server received it (r.URL.RequestURI() when it is empty): a proxy
// in front of the receiver that rewrites the path or the query makes verification fail. Errors
// are ErrNoSecret, ErrMissing, ErrExpired or ErrMismatch (wrapped); comparisons are constant-time.
func (v Verifier) Verify(r *http.Request, body []byte) error {
	target := r.RequestURI
	if target == "" {
		target = r.URL.RequestURI()
	}
	return v.VerifyParts(r.Method, target, r.Header, body)
}

// VerifyParts is Verify for a request given as its parts: method, request target (path and
// query as received) and headers.
func (v Verifier) VerifyParts(method, target string, h http.Header, body []byte) error {
	if len(v.Secrets) == 0 {
		return ErrNoSecret
	}
	tsText, delivery := h.Get(TimestampHeader), h.Get(DeliveryHeader)
	ts, err := strconv.ParseInt(tsText, 10, 64)
	if err != nil || ts < 0 || len(tsText) > 19 || tsText[0] == '+' || delivery == "" {
		return ErrMissing
	}
	tol := v.Tolerance
	if tol <= 0 {
		tol = DefaultTolerance
	}
	now := time.Now
	if v.Now != nil {
		now = v.Now
	}
	skew := now().Unix() - ts
	if skew > int64(tol/time.Second) || -skew > int64(tol/time.Second) {
		return fmt.Errorf("%w: %ds away from this clock, at most %s accepted", ErrExpired, skew, tol)
	}
	var sigs [][]byte
	for _, hv := range h.Values(SignatureHeader) {
		for _, part := range strings.Split(hv, ",") {
			scheme, val, ok := strings.Cut(strings.TrimSpace(part), "=")
			if !ok || scheme != Scheme || len(sigs) == maxValues {
				continue
			}
			if b, err := hex.DecodeString(val); err == nil && len(b) == sha256.Size {
				sigs = append(sigs, b)
			}
		}
	}
	if len(sigs) == 0 {
		return ErrMissing
	}
	msg := Message(ts, method, target, delivery, body)
	ok := 0
	for _, s := range v.Secrets {
		want := mac(s, msg)
		for _, got := range sigs {
			ok |= subtle.ConstantTimeCompare(want, got) // every pair is compared
		}
	}
	if ok == 0 {
		return ErrMismatch
	}
	return nil
}

// Verify checks r and its raw body with the default tolerance against secrets (see
// Verifier.Verify).
func Verify(r *http.Request, body []byte, secrets ...[]byte) error {
	return Verifier{Secrets: secrets}.Verify(r, body)
}

// Handler wraps next so that it only sees verified requests: it reads the body (at most
// maxBody bytes; 0 means 1 MiB), verifies the request and answers 401 when it does not verify,
// 413 when the body is too large; otherwise next gets the request with its body restored.
func (v Verifier) Handler(maxBody int64, next http.Handler) http.Handler {
	if maxBody <= 0 {
		maxBody = 1 << 20
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
		if err != nil {
			http.Error(w, "cannot read the body", http.StatusBadRequest)
			return
		}
		if int64(len(body)) > maxBody {
			http.Error(w, "body too large", http.StatusRequestEntityTooLarge)
			return
		}
		if err := v.Verify(r, body); err != nil {
			http.Error(w, "signature does not verify", http.StatusUnauthorized)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
	})
}
