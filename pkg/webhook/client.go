package webhook

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// SignatureHeader carries "sha256=<hex HMAC-SHA256 of the body>" when a signature secret is set.
const SignatureHeader = "X-Spiegel-Signature"

// DefaultTimeout bounds one attempt when neither the request nor the Config names a timeout.
const DefaultTimeout = 30 * time.Second

// maxRedirects bounds the redirects a GET follows.
const maxRedirects = 10

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

// Config configures a Client. The zero value works: no passwords, any host, 30s timeout.
type Config struct {
	// Timeout bounds one attempt of a request whose own Timeout is 0 (default 30s).
	Timeout time.Duration
	// AllowedHosts, when not empty, lists the hosts requests and redirects may go to: a hostname
	// ("api.example"), a host with port ("api.example:8443") or a subdomain wildcard
	// ("*.example"). Case-insensitive.
	AllowedHosts []string
	// Passwords injects the password of the URL's user (may be nil).
	Passwords Passwords
	// SignatureSecret names a secret of Passwords; when set every request is signed with it and
	// a missing secret fails the attempt (a request is never sent unsigned).
	SignatureSecret string
	// Metrics records each attempt (may be nil).
	Metrics Recorder
	// Transport sends the requests (default: a clone of http.DefaultTransport with more idle
	// connections per host).
	Transport http.RoundTripper
	// MaxParallel is how many requests the caller may have in flight at once; the default
	// transport keeps that many idle connections per host (at least 64).
	MaxParallel int
}

// Client sends webhook requests. It is safe for concurrent use.
type Client struct {
	cfg Config
	hc  *http.Client
}

// New returns a client for cfg.
func New(cfg Config) *Client {
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	tr := cfg.Transport
	if tr == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 64
		if cfg.MaxParallel > t.MaxIdleConnsPerHost {
			// Keep a connection for every request that may run at once: with fewer, each
			// request beyond them dials a new connection and closes it after (churn that
			// costs more than the request itself on a fast receiver).
			t.MaxIdleConnsPerHost = cfg.MaxParallel
		}
		t.MaxIdleConns = max(t.MaxIdleConns, t.MaxIdleConnsPerHost)
		tr = t
	}
	c := &Client{cfg: cfg}
	c.hc = &http.Client{Transport: tr, CheckRedirect: c.checkRedirect}
	return c
}

// checkRedirect follows redirects for GET only (SPEC §2.2), never to a host outside the
// allow-list; for other methods the 3xx answer itself is the result (a failure).
func (c *Client) checkRedirect(req *http.Request, via []*http.Request) error {
	if via[0].Method != http.MethodGet {
		return http.ErrUseLastResponse
	}
	if len(via) >= maxRedirects {
		return fmt.Errorf("stopped after %d redirects", maxRedirects)
	}
	if !c.allowed(req.URL) {
		return ErrHostNotAllowed
	}
	return nil
}

// allowed reports whether u's host is in the allow-list (always, when the list is empty).
func (c *Client) allowed(u *url.URL) bool {
	if len(c.cfg.AllowedHosts) == 0 {
		return true
	}
	host, hostPort := strings.ToLower(u.Hostname()), strings.ToLower(u.Host)
	for _, a := range c.cfg.AllowedHosts {
		a = strings.ToLower(strings.TrimSpace(a))
		switch {
		case a == "":
		case a == host || a == hostPort:
			return true
		case strings.HasPrefix(a, "*.") && strings.HasSuffix(host, a[1:]):
			return true
		}
	}
	return false
}

// Error is a failed attempt. Its text names the method, the URL without password and the
// reason; it never holds a password.
type Error struct {
	Method string
	URL    string // without password
	// Status is the HTTP status of the answer, 0 when there was none.
	Status int
	// Permanent is true when retrying cannot help (bad URL, host not allowed).
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

// StatusOf returns the HTTP status of a failed attempt, 0 when there was no answer.
func StatusOf(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

// Send makes one attempt of req and returns the answer's status (0 when there was none) and nil
// for any 2xx. Everything else is an *Error: a 3xx (for GET only after redirects could not be
// followed), 4xx or 5xx answer, a transport failure, a timeout, ctx ending, or, Permanent, a
// URL that does not parse or whose host is not allowed. The password of the URL's user is
// injected here and never leaves this function.
func (c *Client) Send(ctx context.Context, req Request) (int, error) {
	safeURL := logging.RedactURL(req.URL)
	fail := func(status int, permanent bool, cause error, format string, args ...any) (int, error) {
		msg := fmt.Sprintf("%s %s: %s", req.Method, safeURL, fmt.Sprintf(format, args...))
		return status, &Error{Method: req.Method, URL: safeURL, Status: status, Permanent: permanent, msg: logging.RedactText(msg), cause: cause}
	}
	u, err := url.Parse(req.URL)
	if err != nil || u.Host == "" {
		return fail(0, true, ErrBadRequest, "the URL does not parse")
	}
	if !c.allowed(u) {
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
	if c.cfg.SignatureSecret != "" {
		secret, ok := "", false
		if c.cfg.Passwords != nil {
			secret, ok = c.cfg.Passwords.Secret(c.cfg.SignatureSecret)
		}
		if !ok {
			return fail(0, false, nil, "signature secret %q is not in the passwords file", c.cfg.SignatureSecret)
		}
		hreq.Header.Set(SignatureHeader, Sign([]byte(secret), req.Body))
	}

	start := time.Now()
	resp, err := c.hc.Do(hreq)
	took := time.Since(start)
	if err != nil {
		c.record(0, took)
		var cause error
		switch {
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
	if resp.StatusCode >= 300 && resp.StatusCode < 400 && req.Method != http.MethodGet {
		return fail(resp.StatusCode, false, nil, "%s (redirects are followed for GET only)", resp.Status)
	}
	return fail(resp.StatusCode, false, nil, "%s", resp.Status)
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

// Sign returns the X-Spiegel-Signature value of body: "sha256=" and the hex HMAC-SHA256 of body
// keyed with secret. Receivers recompute it over the raw body they received.
func Sign(secret, body []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}
