package webhook

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/webhook/signature"
)

// The headers every request carries (see package signature for their meaning).
const (
	TimestampHeader = signature.TimestampHeader
	DeliveryHeader  = signature.DeliveryHeader
	SignatureHeader = signature.SignatureHeader

	StandardIDHeader        = signature.StandardIDHeader
	StandardTimestampHeader = signature.StandardTimestampHeader
	StandardSignatureHeader = signature.StandardSignatureHeader
)

// DefaultTimeout bounds one attempt when neither the request nor the Config names a timeout.
const DefaultTimeout = 30 * time.Second

// maxRedirects bounds the redirects a request that follows them follows.
const maxRedirects = 5

// ErrHostNotAllowed means the URL's host is not in the allow-list (SPIEGEL_WEBHOOK_ALLOWED_HOSTS);
// the request is never sent.
var ErrHostNotAllowed = errors.New("webhook: host not in the allowed hosts")

// Passwords supplies URL passwords and named secrets at send time (*passwords.File).
type Passwords interface {
	Inject(rawURL string) (string, error)
	Secret(name string) (string, bool)
}

// Recorder is told about every attempt: the HTTP status (0 when there was no answer) and how
// long it took (*metrics.Consumer). It is called concurrently and must not block.
type Recorder interface {
	Webhook(status int, d time.Duration)
}

// Config configures a Client. The zero value works: no passwords, no signature, 30s timeout,
// public addresses only.
type Config struct {
	// Timeout bounds one attempt of a request whose own Timeout is 0 (default 30s).
	Timeout time.Duration
	// AllowedHosts is SPIEGEL_WEBHOOK_ALLOWED_HOSTS. Empty: any host may be called, but never at
	// a loopback, private, link-local, CGNAT or other non-public address (checked on the address
	// dialled). Not empty: only the hosts it names are called — a hostname ("api.example"), a
	// host with port ("api.example:8443"), a subdomain wildcard ("*.example") or an IP literal
	// ("127.0.0.1"), matched against the URL's host as written, which may then be dialled at
	// whatever address it resolves to — and any host whose address dialled falls in one of its
	// CIDR ranges ("10.0.0.0/8"). Case-insensitive.
	AllowedHosts []string
	// Passwords injects the password of the URL's user (may be nil).
	Passwords Passwords
	// SignatureSecrets names secrets of Passwords; when set every request is signed with each
	// (several while a secret is rotated), in the scheme or schemes its rule asks for, and a
	// missing secret fails the attempt (a request is never sent unsigned). The v1 scheme keys
	// its HMAC with the secret's bytes as written; the Standard Webhooks scheme with the
	// base64-decoded part of a secret written "whsec_<base64>", else with its bytes as written
	// (signature.StandardKey), so one secret serves both.
	SignatureSecrets []string
	// Metrics records each attempt (may be nil).
	Metrics Recorder
	// Resolver resolves host names (default net.DefaultResolver). Whatever it answers, the
	// address actually dialled is checked.
	Resolver Resolver
	// MaxParallel is how many requests the caller may have in flight at once; the transport
	// keeps that many idle connections per host (at least 64).
	MaxParallel int
	// Instance, when set, is sent as X-Spiegel-Instance on every attempt: which process made
	// the call (the onchange consumer sends "<hostname>/<pid>"), so that a receiver can tell
	// which instance called. Not signed.
	Instance string
}

// InstanceHeader names the process that sent a request (Config.Instance).
const InstanceHeader = "X-Spiegel-Instance"

// InstanceName is the Instance the consumers send: "<hostname>/<pid>", unique among the
// processes of one host (container or machine).
func InstanceName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return fmt.Sprintf("%s/%d", host, os.Getpid())
}

// Client sends webhook requests. It is safe for concurrent use.
type Client struct {
	cfg   Config
	allow allowList
	tr    *http.Transport
	now   func() time.Time
}

// New returns a client for cfg. Its transport ignores HTTP(S)_PROXY (a proxy would hide the
// address actually called from the address check) and dials through the address check.
func New(cfg Config) *Client {
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	c := &Client{cfg: cfg, allow: parseAllowList(cfg.AllowedHosts), now: time.Now}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	t.DialContext = (&dialer{allow: c.allow, resolver: cfg.Resolver}).DialContext
	t.MaxIdleConnsPerHost = 64
	if cfg.MaxParallel > t.MaxIdleConnsPerHost {
		// Keep a connection for every request that may run at once: with fewer, each request
		// beyond them dials a new connection and closes it after (churn that costs more than
		// the request itself on a fast receiver).
		t.MaxIdleConnsPerHost = cfg.MaxParallel
	}
	t.MaxIdleConns = max(t.MaxIdleConns, t.MaxIdleConnsPerHost)
	c.tr = t
	return c
}

// Error is a failed attempt. Its text names the method, the URL without password and the
// reason; it never holds a password.
type Error struct {
	Method string
	URL    string // without password
	// Status is the HTTP status of the answer, 0 when there was none.
	Status int
	// Permanent is true when retrying cannot help (bad URL, host or address not allowed).
	Permanent bool
	msg       string
	cause     error // a sentinel or context error, never an error that could quote the URL
}

func (e *Error) Error() string { return e.msg }
func (e *Error) Unwrap() error { return e.cause }

// IsPermanent reports whether err is an attempt error that retrying cannot fix.
func IsPermanent(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Permanent || errors.Is(err, ErrBadRequest)
}

// StatusOf returns the HTTP status of a failed attempt, 0 when there was none.
func StatusOf(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

// Send makes one attempt of req and returns the answer's status (0 when there was none) and nil
// for any 2xx. Everything else is an *Error: a 3xx (unless req follows redirects), 4xx or 5xx
// answer, a transport failure, a timeout, ctx ending, or, Permanent, a URL that does not parse,
// a host the allow-list refuses or an address the address check refuses (ErrHostNotAllowed,
// ErrAddressNotAllowed). The password of the URL's user is injected here and never leaves this
// function. Every attempt carries X-Spiegel-Instance (Config.Instance, when set) and the headers
// of req.Signing: for rules.SigningV1 (or ""), X-Spiegel-Timestamp (now), X-Spiegel-Delivery
// (req.Delivery, the same for every attempt) and, with signature secrets, X-Spiegel-Signature;
// for rules.SigningStandard, webhook-timestamp, webhook-id (the same values) and, with
// signature secrets, webhook-signature; for rules.SigningBoth, all six. A whsec_ secret that is
// not base64 fails a standard-signed attempt (the error names the secret, never its value).
func (c *Client) Send(ctx context.Context, req Request) (int, error) {
	safeURL := logging.RedactURL(req.URL)
	fail := func(status int, permanent bool, cause error, format string, args ...any) (int, error) {
		msg := fmt.Sprintf("%s %s: %s", req.Method, safeURL, fmt.Sprintf(format, args...))
		return status, &Error{Method: req.Method, URL: safeURL, Status: status, Permanent: permanent, msg: logging.RedactText(msg), cause: cause}
	}
	u, err := url.Parse(req.URL)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return fail(0, true, ErrBadRequest, "the URL is not an absolute http(s) URL")
	}
	if !c.allow.mayCall(u) {
		return fail(0, true, ErrHostNotAllowed, "host %q is not in SPIEGEL_WEBHOOK_ALLOWED_HOSTS", u.Host)
	}
	full, password := req.URL, ""
	if c.cfg.Passwords != nil {
		if full, err = c.cfg.Passwords.Inject(req.URL); err != nil {
			return fail(0, true, ErrBadRequest, "the URL does not parse")
		}
		if fu, err := url.Parse(full); err == nil && fu.User != nil {
			password, _ = fu.User.Password()
		}
	}
	s, err := c.signer(req)
	if err != nil {
		var cause error
		if errors.Is(err, signature.ErrStandardSecret) {
			cause = signature.ErrStandardSecret
		}
		return fail(0, false, cause, "%v", err)
	}
	timeout := req.Timeout
	if timeout <= 0 {
		timeout = c.cfg.Timeout
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hreq, err := http.NewRequestWithContext(actx, req.Method, full, bytes.NewReader(req.Body))
	if err != nil {
		return fail(0, true, ErrBadRequest, "build request: %s", hide(err.Error(), password))
	}
	for k, vs := range req.Header {
		hreq.Header[k] = append([]string(nil), vs...)
	}
	if hreq.Header.Get("User-Agent") == "" {
		hreq.Header.Set("User-Agent", "spiegel-nats")
	}
	if c.cfg.Instance != "" {
		hreq.Header.Set(InstanceHeader, c.cfg.Instance)
	}
	s.sign(hreq, req.Body)

	hc := &http.Client{Transport: c.tr, CheckRedirect: c.redirectPolicy(req, s)}
	start := time.Now()
	resp, err := hc.Do(hreq)
	took := time.Since(start)
	if err != nil {
		c.record(0, took)
		var cause error
		var refused *addressError
		switch {
		case errors.As(err, &refused):
			return fail(0, true, ErrAddressNotAllowed, "%s", refused.Error())
		case errors.Is(err, ErrHostNotAllowed):
			return fail(0, true, ErrHostNotAllowed, "redirected to a host not in SPIEGEL_WEBHOOK_ALLOWED_HOSTS")
		case ctx.Err() != nil:
			cause = ctx.Err()
		case errors.Is(err, context.DeadlineExceeded):
			return fail(0, false, context.DeadlineExceeded, "no answer within %s", timeout)
		}
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err // url.Error quotes the URL, password included
		}
		return fail(0, false, cause, "%s", hide(err.Error(), password))
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	c.record(resp.StatusCode, took)
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return resp.StatusCode, nil
	}
	if resp.StatusCode >= 300 && resp.StatusCode < 400 && !req.FollowRedirects {
		return fail(resp.StatusCode, false, nil, "%s (redirects are followed only for rules with \"follow_redirects\": true)", resp.Status)
	}
	return fail(resp.StatusCode, false, nil, "%s", resp.Status)
}

// redirectPolicy is the CheckRedirect of one attempt of req. Redirects are followed only when
// the rule asks (req.FollowRedirects), at most maxRedirects, only to hosts the allow-list allows
// (the address check applies to every connection anyway). Once the chain leaves the first
// request's origin (scheme, host and port), the rule's headers, the URL's credentials, cookies
// and the signatures are dropped: only User-Agent, Content-Type, the timestamps and the delivery
// ids go on (neither scheme's signature binds the host, so another host must not get one it
// could replay). Within the origin the request is signed again for its new method, target and
// body.
func (c *Client) redirectPolicy(req Request, s *signer) func(*http.Request, []*http.Request) error {
	return func(next *http.Request, via []*http.Request) error {
		if !req.FollowRedirects {
			return http.ErrUseLastResponse
		}
		if len(via) > maxRedirects {
			return fmt.Errorf("stopped after %d redirects", maxRedirects)
		}
		if !c.allow.mayCall(next.URL) {
			return ErrHostNotAllowed
		}
		var body []byte
		if next.Body != nil && next.Body != http.NoBody {
			body = s.body // 307 and 308 send the body again; 301, 302 and 303 turn into a GET without one
		}
		left := !sameOrigin(via[0].URL, next.URL)
		for _, r := range via[1:] {
			left = left || !sameOrigin(via[0].URL, r.URL)
		}
		if !left {
			next.Header.Del("Referer")
			s.sign(next, body)
			return nil
		}
		h := http.Header{}
		h.Set("User-Agent", via[0].Header.Get("User-Agent"))
		if ct := via[0].Header.Get("Content-Type"); ct != "" && body != nil {
			h.Set("Content-Type", ct)
		}
		next.Header = h
		next.URL.User = nil
		(&signer{v1: s.v1, standard: s.standard, ts: s.ts, delivery: s.delivery}).sign(next, body)
		return nil
	}
}

// sameOrigin reports whether a and b have the same scheme, host and port.
func sameOrigin(a, b *url.URL) bool {
	return a.Scheme == b.Scheme && strings.EqualFold(a.Hostname(), b.Hostname()) && urlPort(a) == urlPort(b)
}

func (c *Client) record(status int, d time.Duration) {
	if c.cfg.Metrics != nil {
		c.cfg.Metrics.Webhook(status, d)
	}
}

// hide removes password from s (belt and braces: library errors should not quote the URL).
func hide(s, password string) string {
	if password != "" {
		s = strings.ReplaceAll(s, password, "xxxxx")
		s = strings.ReplaceAll(s, url.QueryEscape(password), "xxxxx")
	}
	return s
}
