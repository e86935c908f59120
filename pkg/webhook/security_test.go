package webhook

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/passwords"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/webhook/signature"
)

// fakeResolver answers from a table; answers[host] lists one answer per lookup, the last one
// repeating.
type fakeResolver struct {
	mu      sync.Mutex
	answers map[string][]string
	lookups map[string]int
}

func (f *fakeResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	seq, ok := f.answers[host]
	if !ok {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	if f.lookups == nil {
		f.lookups = map[string]int{}
	}
	n := min(f.lookups[host], len(seq)-1)
	f.lookups[host]++
	return []netip.Addr{netip.MustParseAddr(seq[n])}, nil
}

func resolving(answers map[string][]string) *fakeResolver { return &fakeResolver{answers: answers} }

func TestNonPublic(t *testing.T) {
	t.Parallel()
	refused := map[string]string{
		"127.0.0.1":              "loopback",
		"127.255.0.9":            "loopback",
		"10.1.2.3":               "private",
		"172.31.255.1":           "private",
		"192.168.0.1":            "private",
		"169.254.169.254":        "link-local", // cloud metadata
		"100.64.0.1":             "CGNAT",
		"100.127.255.254":        "CGNAT",
		"0.0.0.0":                "unspecified",
		"255.255.255.255":        "broadcast",
		"224.0.0.1":              "multicast",
		"198.18.0.1":             "benchmarking",
		"::":                     "unspecified",
		"::1":                    "loopback",
		"fe80::1":                "link-local",
		"fe80::1%lo":             "link-local",
		"fd00::1":                "unique local",
		"ff02::1":                "multicast",
		"::ffff:127.0.0.1":       "loopback", // IPv4-mapped
		"::ffff:169.254.169.254": "link-local",
		"::127.0.0.1":            "not a global unicast", // IPv4-compatible (deprecated)
		"64:ff9b::a00:1":         "NAT64 address of a private",
		"2002:7f00:1::1":         "6to4 address of a loopback",
		"2001:db8::1":            "documentation",
		"2001::1":                "Teredo",
		"64:ff9b:1::1":           "local NAT64",
		"100::1":                 "not a global unicast",
		"fec0::1":                "not a global unicast",
	}
	for ip, want := range refused {
		assert.Contains(t, nonPublic(netip.MustParseAddr(ip)), want, ip)
	}
	for _, ip := range []string{"1.1.1.1", "8.8.8.8", "100.63.255.255", "100.128.0.0", "172.32.0.1", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"} {
		assert.Empty(t, nonPublic(netip.MustParseAddr(ip)), ip)
	}
}

// TestAllowListPorts: an allow-list entry with a port names that port only, for a name and for
// an address (written as Go writes it); a port that is no number matches no such entry.
func TestAllowListPorts(t *testing.T) {
	t.Parallel()
	a := parseAllowList([]string{"hooks.example:8443", "10.0.0.5:9000", "[fd00::1]:80"})
	for _, c := range []struct {
		host, port string
		want       bool
	}{
		{"hooks.example", "8443", true}, {"HOOKS.example", "8443", true}, {"hooks.example", "443", false},
		{"10.0.0.5", "9000", true}, {"10.0.0.5", "09000", true}, {"10.0.0.5", "900", false},
		{"fd00::1", "80", true}, {"fd00:0::1", "80", true}, {"fd00::1", "8080", false},
		{"10.0.0.5", "x9000", false}, {"10.0.0.5", "65536", false}, {"10.0.0.5", "", false},
	} {
		assert.Equal(t, c.want, a.named(c.host, c.port), "%s port %q", c.host, c.port)
	}
	assert.Equal(t, uint16(65535), parsePort("65535"))
	assert.Zero(t, parsePort("65536"))
	assert.Zero(t, parsePort("-1"))
}

// hookServer is a receiver that counts its requests.
type hookServer struct {
	*httptest.Server
	n atomic.Int64
}

func newHookServer(t *testing.T) *hookServer {
	h := &hookServer{}
	h.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { h.n.Add(1) }))
	t.Cleanup(h.Close)
	return h
}

func (h *hookServer) port() string { u, _ := url.Parse(h.URL); return u.Port() }

// TestClosedByDefault: without an allow-list loopback is refused on the address dialled, whatever
// name leads there, permanently and before any byte is sent; the allow-list opens what it
// names, by name or by range.
func TestClosedByDefault(t *testing.T) {
	t.Parallel()
	hook := newHookServer(t)
	port := hook.port()
	res := resolving(map[string][]string{"hook.test": {"127.0.0.1"}, "mapped.test": {"::ffff:127.0.0.1"}})
	cases := []struct {
		name    string
		allow   []string
		url     string
		wantErr error // nil: the call reaches the receiver
		wantMsg string
	}{
		{"no list: a name resolving to loopback", nil, "http://hook.test:" + port + "/", ErrAddressNotAllowed, `host "hook.test" refused: the address dialled is a loopback address`},
		{"no list: a loopback literal", nil, "http://127.0.0.1:" + port + "/", ErrAddressNotAllowed, "loopback"},
		{"no list: an IPv4-mapped loopback", nil, "http://mapped.test:" + port + "/", ErrAddressNotAllowed, "loopback"},
		{"no list: the metadata address", nil, "http://169.254.169.254:" + port + "/", ErrAddressNotAllowed, "link-local"},
		{"no list: unspecified", nil, "http://0.0.0.0:" + port + "/", ErrAddressNotAllowed, "unspecified"},
		{"named host, any address", []string{"hook.test"}, "http://hook.test:" + port + "/", nil, ""},
		{"named host with its port", []string{"hook.test:" + port}, "http://hook.test:" + port + "/", nil, ""},
		{"named host on another port", []string{"hook.test:1"}, "http://hook.test:" + port + "/", ErrHostNotAllowed, "not in SPIEGEL_WEBHOOK_ALLOWED_HOSTS"},
		{"wildcard", []string{"*.test"}, "http://hook.test:" + port + "/", nil, ""},
		{"an IP literal named", []string{"127.0.0.1"}, "http://127.0.0.1:" + port + "/", nil, ""},
		{"an IP literal named does not name the hosts resolving to it", []string{"127.0.0.1"}, "http://hook.test:" + port + "/", ErrHostNotAllowed, "not in SPIEGEL_WEBHOOK_ALLOWED_HOSTS"},
		{"the issue's example: localhost", []string{"127.0.0.1"}, "http://localhost:" + port + "/", ErrHostNotAllowed, "not in SPIEGEL_WEBHOOK_ALLOWED_HOSTS"},
		{"a range holding the address dialled", []string{"127.0.0.0/8"}, "http://hook.test:" + port + "/", nil, ""},
		{"a range not holding it", []string{"10.0.0.0/8"}, "http://hook.test:" + port + "/", ErrAddressNotAllowed, "in none of its ranges"},
		{"a range holding a mapped address", []string{"127.0.0.1/32"}, "http://mapped.test:" + port + "/", nil, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := hook.n.Load()
			c := New(Config{AllowedHosts: tc.allow, Resolver: res})
			out := c.Deliver(t.Context(), Request{Method: "GET", URL: tc.url}, Retry{Policy: rules.RetryPolicy{Backoff: rules.BackoffLinear, BaseDelay: time.Millisecond, Limit: 5}})
			if tc.wantErr == nil {
				require.NoError(t, out.Err)
				assert.Equal(t, before+1, hook.n.Load())
				return
			}
			require.ErrorIs(t, out.Err, tc.wantErr)
			assert.Contains(t, out.Err.Error(), tc.wantMsg)
			assert.True(t, out.GaveUp)
			assert.Equal(t, 1, out.Attempts, "a refused request is never retried")
			assert.Equal(t, before, hook.n.Load(), "nothing reached the receiver")
			if strings.Contains(tc.url, ".test:") {
				assert.NotRegexp(t, `127\.0\.0\.1|::ffff`, out.Err.Error(), "the error does not show the address a name resolved to")
			}
		})
	}
}

// TestDNSRebinding: a name whose answer changes between two lookups (first an allowed address,
// then a forbidden one) cannot reach the forbidden address: the check runs on the address each
// connection actually goes to, not on an earlier answer. Two receivers listen on the same port,
// one on 127.0.0.2 (allowed by range) and one on 127.0.0.1 (the "internal" service).
func TestDNSRebinding(t *testing.T) {
	t.Parallel()
	var allowedHits, internalHits atomic.Int64
	allowed, internal := listenPair(t)
	serve := func(ln net.Listener, n *atomic.Int64) {
		s := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { n.Add(1) })}
		s.SetKeepAlivesEnabled(false) // every request dials again, and resolves again
		go func() { _ = s.Serve(ln) }()
		t.Cleanup(func() { _ = s.Close() })
	}
	serve(allowed, &allowedHits)
	serve(internal, &internalHits)
	_, port, _ := net.SplitHostPort(allowed.Addr().String())
	res := resolving(map[string][]string{"rebind.test": {"127.0.0.2", "127.0.0.1"}})
	c := New(Config{AllowedHosts: []string{"127.0.0.2/32"}, Resolver: res})
	req := Request{Method: "GET", URL: "http://rebind.test:" + port + "/"}

	_, err := c.Send(t.Context(), req)
	require.NoError(t, err)
	assert.EqualValues(t, 1, allowedHits.Load())
	_, err = c.Send(t.Context(), req) // the name now resolves to 127.0.0.1
	require.ErrorIs(t, err, ErrAddressNotAllowed)
	assert.True(t, IsPermanent(err))
	assert.Zero(t, internalHits.Load(), "the rebound name never reached the internal service")
	res.mu.Lock()
	assert.Equal(t, 2, res.lookups["rebind.test"], "one lookup per connection: no separate check lookup")
	res.mu.Unlock()
}

// listenPair listens on 127.0.0.2 and 127.0.0.1 on the same port.
func listenPair(t *testing.T) (net.Listener, net.Listener) {
	for range 20 {
		a, err := net.Listen("tcp", "127.0.0.2:0")
		if err != nil {
			t.Skipf("cannot listen on 127.0.0.2: %v", err)
		}
		_, port, _ := net.SplitHostPort(a.Addr().String())
		b, err := net.Listen("tcp", "127.0.0.1:"+port)
		if err == nil {
			return a, b
		}
		_ = a.Close()
	}
	t.Fatal("no port free on both 127.0.0.1 and 127.0.0.2")
	return nil, nil
}

// TestSignatureBindsRequest: the receiver's verifier (package signature) accepts what the client
// sends and nothing else: two GETs that differ only in their query carry different signatures,
// and a delivery id is the same for every attempt of a request and differs between changes.
func TestSignatureBindsRequest(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	type seen struct{ sig, delivery, ts, verifyErr string }
	var got []seen
	var fail atomic.Int64
	fail.Store(2)
	verifier := signature.Verifier{Secrets: [][]byte{[]byte("k")}, Tolerance: time.Minute}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s := seen{sig: r.Header.Get(SignatureHeader), delivery: r.Header.Get(DeliveryHeader), ts: r.Header.Get(TimestampHeader)}
		if err := verifier.Verify(r, body); err != nil {
			s.verifyErr = err.Error()
		}
		mu.Lock()
		got = append(got, s)
		mu.Unlock()
		if r.URL.Query().Get("retry") != "" && fail.Add(-1) >= 0 {
			w.WriteHeader(503)
		}
	}))
	defer srv.Close()
	file := filepath.Join(t.TempDir(), "pw.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"_secrets": {"hmac": "k"}}`), 0o600))
	pw, err := passwords.Load(file)
	require.NoError(t, err)
	c := New(Config{Passwords: pw, SignatureSecrets: []string{"hmac"}, AllowedHosts: loopback})

	rule := mustRule(t, map[string]any{"url": srv.URL + "/hook/${db_name}", "params": map[string]any{"id": "$change.id"}})
	a, err := Build(rule, vars("db1", map[string]any{"_id": "a", "_rev": "1-a"}))
	require.NoError(t, err)
	b, err := Build(rule, vars("db1", map[string]any{"_id": "b", "_rev": "1-b"}))
	require.NoError(t, err)
	a2, err := Build(rule, vars("db1", map[string]any{"_id": "a", "_rev": "1-a"}))
	require.NoError(t, err)
	assert.Equal(t, a.Delivery, a2.Delivery, "the same change gives the same delivery id (a redelivered job)")
	assert.NotEqual(t, a.Delivery, b.Delivery)
	assert.Regexp(t, `^[0-9a-f]{32}$`, a.Delivery)

	for _, r := range []Request{a, b} {
		_, err := c.Send(t.Context(), r)
		require.NoError(t, err)
	}
	retried := a
	retried.URL += "&retry=1"
	out := c.Deliver(t.Context(), retried, Retry{Policy: rules.RetryPolicy{Backoff: rules.BackoffLinear, BaseDelay: time.Millisecond, Limit: 5}})
	require.NoError(t, out.Err)
	require.Equal(t, 3, out.Attempts)

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, got, 5)
	for i, s := range got {
		assert.Empty(t, s.verifyErr, "request %d verifies", i)
		assert.NotEmpty(t, s.ts)
	}
	assert.NotEqual(t, got[0].sig, got[1].sig, "GETs differing in their query only are signed differently")
	assert.Equal(t, got[2].delivery, got[3].delivery)
	assert.Equal(t, got[3].delivery, got[4].delivery, "every attempt of a request has the same delivery id")
	assert.Equal(t, a.Delivery, got[0].delivery)
}

// TestRedirects: a rule that follows redirects keeps its headers and credentials within the
// first request's origin (signed again for the new target), and drops them, with the signature,
// once the chain goes to another host, for the rest of the chain; it never goes to a host outside
// the allow-list.
func TestRedirects(t *testing.T) {
	t.Parallel()
	type seen struct {
		host, path, token, auth, referer, verifyErr, delivery string
		signed                                                bool
	}
	var mu sync.Mutex
	var got []seen
	verifier := signature.Verifier{Secrets: [][]byte{[]byte("k")}}
	var other *httptest.Server
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s := seen{host: r.Host, path: r.URL.Path, token: r.Header.Get("X-Token"), auth: r.Header.Get("Authorization"),
			referer: r.Header.Get("Referer"), delivery: r.Header.Get(DeliveryHeader), signed: r.Header.Get(SignatureHeader) != ""}
		if err := verifier.Verify(r, body); err != nil {
			s.verifyErr = err.Error()
		}
		mu.Lock()
		got = append(got, s)
		mu.Unlock()
		switch r.URL.Path {
		case "/start":
			http.Redirect(w, r, "/same?x=1", http.StatusTemporaryRedirect)
		case "/same":
			http.Redirect(w, r, "http://b.test:"+strings.Split(other.URL, ":")[2]+"/away", http.StatusTemporaryRedirect)
		case "/away":
			http.Redirect(w, r, "http://a.test:"+strings.Split(other.URL, ":")[2]+"/back", http.StatusTemporaryRedirect)
		}
	}))
	defer srv.Close()
	other = srv // the same server under another name
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
	res := resolving(map[string][]string{"a.test": {"127.0.0.1"}, "b.test": {"127.0.0.1"}})
	file := filepath.Join(t.TempDir(), "pw.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"a.test": {"hook": "pw-a"}, "_secrets": {"hmac": "k"}}`), 0o600))
	pw, err := passwords.Load(file)
	require.NoError(t, err)
	req := Request{Method: "PUT", URL: "http://hook@a.test:" + port + "/start", Body: []byte(`{"a":1}`),
		Header: http.Header{"X-Token": {"rule-secret"}, "Content-Type": {"application/json"}}, FollowRedirects: true}

	c := New(Config{Passwords: pw, SignatureSecrets: []string{"hmac"}, AllowedHosts: []string{"a.test", "b.test"}, Resolver: res})
	_, err = c.Send(t.Context(), req)
	require.NoError(t, err)
	mu.Lock()
	require.Len(t, got, 4)
	start, same, away, back := got[0], got[1], got[2], got[3]
	mu.Unlock()
	for _, s := range []seen{start, same} {
		assert.Equal(t, "rule-secret", s.token, s.path)
		assert.NotEmpty(t, s.auth, s.path)
		assert.Empty(t, s.verifyErr, "%s verifies", s.path)
	}
	assert.Empty(t, same.referer)
	assert.Equal(t, "/away", away.path)
	assert.Empty(t, away.token, "rule headers are dropped on a change of host")
	assert.Empty(t, away.auth, "credentials are dropped on a change of host")
	assert.Empty(t, away.referer)
	assert.False(t, away.signed, "no signature another host could replay")
	assert.Equal(t, start.delivery, away.delivery)
	assert.Equal(t, "/back", back.path)
	assert.Empty(t, back.token, "coming back to the first host does not bring the headers back")
	assert.Empty(t, back.auth)
	assert.False(t, back.signed)

	// Another host outside the allow-list: refused, never called.
	mu.Lock()
	got = nil
	mu.Unlock()
	c = New(Config{Passwords: pw, AllowedHosts: []string{"a.test"}, Resolver: res})
	_, err = c.Send(t.Context(), req)
	require.ErrorIs(t, err, ErrHostNotAllowed)
	mu.Lock()
	assert.Len(t, got, 2, "/start and /same only")
	mu.Unlock()

	// Without follow_redirects the 307 is the answer.
	req.FollowRedirects = false
	status, err := c.Send(t.Context(), req)
	require.Error(t, err)
	assert.Equal(t, http.StatusTemporaryRedirect, status)
	assert.Contains(t, err.Error(), "follow_redirects")
}

// TestNoProxy: HTTP(S)_PROXY does not apply to webhooks (a proxy would hide the address called).
func TestNoProxy(t *testing.T) {
	t.Parallel()
	assert.Nil(t, New(Config{}).tr.Proxy)
}

// TestSystemResolver: with the system resolver, a named localhost is reached (whichever of its
// addresses answers: the receiver listens on 127.0.0.1 only, so a ::1 answered first fails over
// to the next address), and the same URL is refused without the name in the list.
func TestSystemResolver(t *testing.T) {
	t.Parallel()
	hook := newHookServer(t)
	u := "http://localhost:" + hook.port() + "/"
	_, err := New(Config{AllowedHosts: []string{"localhost"}}).Send(t.Context(), Request{Method: "GET", URL: u})
	require.NoError(t, err)
	assert.EqualValues(t, 1, hook.n.Load())
	_, err = New(Config{}).Send(t.Context(), Request{Method: "GET", URL: u})
	require.ErrorIs(t, err, ErrAddressNotAllowed)
	assert.EqualValues(t, 1, hook.n.Load())
}
