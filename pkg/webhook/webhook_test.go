package webhook

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
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

// loopback allows the tests' receivers (httptest servers on 127.0.0.1): the address check
// refuses loopback addresses unless the allow-list names them.
var loopback = []string{"127.0.0.1"}

// mustRule parses an on_change rule doc.
func mustRule(t testing.TB, doc map[string]any) *rules.OnChange {
	t.Helper()
	doc["type"] = "on_change"
	raw, err := json.Marshal(doc)
	require.NoError(t, err)
	r, err := rules.Parse("rule1", raw)
	require.NoError(t, err)
	return r.(*rules.OnChange)
}

func vars(db string, doc map[string]any) rules.Vars {
	row := map[string]any{"seq": "7-abc", "id": doc["_id"], "changes": []any{map[string]any{"rev": doc["_rev"]}}, "doc": doc}
	return rules.VarsFromChange(db, row)
}

func TestBuild(t *testing.T) {
	t.Parallel()
	doc := map[string]any{"_id": "d1", "_rev": "1-x", "n": json.Number("12345678901234567890"), "tags": []any{"a", "b"}}
	cases := []struct {
		name      string
		rule      map[string]any
		wantURL   string
		wantBody  string
		wantQuery url.Values
	}{
		{
			name:    "GET params become a bracket-notation query string",
			rule:    map[string]any{"url": "http://h/hook", "params": map[string]any{"db": "$db_name", "id": "$change.id", "n": 42, "nested": map[string]any{"x": []any{1, "y"}}}},
			wantURL: "http://h/hook?db=u%2Fa%2Bb&id=d1&n=42&nested%5Bx%5D%5B0%5D=1&nested%5Bx%5D%5B1%5D=y",
		},
		{
			name:    "GET keeps the template's own query",
			rule:    map[string]any{"url": "http://h/hook?k=v#frag", "params": map[string]any{"a": "$seq"}},
			wantURL: "http://h/hook?k=v&a=7-abc",
		},
		{
			name:     "POST sends JSON, URL template escaped, $change keeps the doc as an object",
			rule:     map[string]any{"url": "https://h/db/${db_name}/${change.id}", "method": "post", "params": map[string]any{"change": "$change", "doc": "$change.doc", "num": 1.5}},
			wantURL:  "https://h/db/u%2Fa%2Bb/d1",
			wantBody: `{"change":{"changes":[{"rev":"1-x"}],"doc":{"_id":"d1","_rev":"1-x","n":12345678901234567890,"tags":["a","b"]},"id":"d1","seq":"7-abc"},"doc":{"_id":"d1","_rev":"1-x","n":12345678901234567890,"tags":["a","b"]},"num":1.5}`,
		},
		{
			name:    "DELETE uses a query string",
			rule:    map[string]any{"url": "http://h/x", "method": "DELETE", "params": map[string]any{"id": "${change.id}-${change.rev}"}},
			wantURL: "http://h/x?id=d1-1-x",
		},
		{
			name:    "PUT without params has no body",
			rule:    map[string]any{"url": "http://h/x/$db_name", "method": "PUT"},
			wantURL: "http://h/x/u%2Fa%2Bb",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			req, err := Build(mustRule(t, tc.rule), vars("u/a+b", doc))
			require.NoError(t, err)
			assert.Equal(t, tc.wantURL, req.URL)
			if tc.wantBody == "" {
				assert.Nil(t, req.Body)
				assert.Empty(t, req.Header.Get("Content-Type"))
			} else {
				assert.JSONEq(t, tc.wantBody, string(req.Body))
				assert.Equal(t, "application/json", req.Header.Get("Content-Type"))
			}
		})
	}
}

func TestBuildKeyAndTimeout(t *testing.T) {
	t.Parallel()
	r := mustRule(t, map[string]any{"url": "http://h/$db_name", "method": "POST", "params": map[string]any{"db": "$db_name"}, "timeout_ms": 1500})
	a, err := Build(r, vars("db1", map[string]any{"_id": "a"}))
	require.NoError(t, err)
	b, err := Build(r, vars("db1", map[string]any{"_id": "b"}))
	require.NoError(t, err)
	c, err := Build(r, vars("db2", map[string]any{"_id": "a"}))
	require.NoError(t, err)
	assert.Equal(t, a.Key(), b.Key(), "same method, URL and body")
	assert.NotEqual(t, a.Key(), c.Key())
	assert.Equal(t, 1500*time.Millisecond, a.Timeout)
	d, err := Build(mustRule(t, map[string]any{"url": "http://h/"}), vars("db1", map[string]any{"_id": "a"}))
	require.NoError(t, err)
	assert.Zero(t, d.Timeout, "rules without timeout_ms take the client's default")
}

// sink is a recording HTTP server answering with status(n) for the n-th request (from 1).
type sink struct {
	*httptest.Server
	mu   sync.Mutex
	reqs []*http.Request
	body []string
	n    atomic.Int64
}

func newSink(t *testing.T, status func(n int, r *http.Request) int) *sink {
	s := &sink{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := int(s.n.Add(1))
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.reqs, s.body = append(s.reqs, r), append(s.body, string(b))
		s.mu.Unlock()
		st := status(n, r)
		if st >= 300 && st < 400 {
			w.Header().Set("Location", "/final")
		}
		w.WriteHeader(st)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *sink) paths() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, r := range s.reqs {
		out = append(out, r.Method+" "+r.URL.Path)
	}
	return out
}

func TestSendClassifiesAnswers(t *testing.T) {
	t.Parallel()
	cases := []struct {
		method    string
		status    int
		follow    bool
		ok        bool
		wantPaths []string
	}{
		{"GET", 200, false, true, []string{"GET /x"}},
		{"POST", 201, false, true, []string{"POST /x"}},
		{"DELETE", 204, false, true, []string{"DELETE /x"}},
		{"GET", 302, false, false, []string{"GET /x"}},               // not followed unless the rule says so
		{"GET", 302, true, true, []string{"GET /x", "GET /final"}},   // followed: /final answers 200
		{"POST", 302, false, false, []string{"POST /x"}},             // not followed
		{"POST", 303, true, true, []string{"POST /x", "GET /final"}}, // followed as a GET
		{"PUT", 307, false, false, []string{"PUT /x"}},               // not followed
		{"PUT", 307, true, true, []string{"PUT /x", "PUT /final"}},   // followed with its body
		{"GET", 404, false, false, []string{"GET /x"}},
		{"PATCH", 400, false, false, []string{"PATCH /x"}},
		{"GET", 500, false, false, []string{"GET /x"}},
		{"POST", 503, false, false, []string{"POST /x"}},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%s %s follow=%v", tc.method, http.StatusText(tc.status), tc.follow), func(t *testing.T) {
			t.Parallel()
			s := newSink(t, func(_ int, r *http.Request) int {
				if r.URL.Path == "/final" {
					return 200
				}
				return tc.status
			})
			status, err := New(Config{AllowedHosts: loopback}).Send(t.Context(), Request{Method: tc.method, URL: s.URL + "/x", Body: []byte("{}"), FollowRedirects: tc.follow})
			assert.Equal(t, tc.wantPaths, s.paths())
			if tc.ok {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Equal(t, tc.status, status)
			assert.Equal(t, tc.status, StatusOf(err))
			assert.False(t, IsPermanent(err), "every answer is retried, as Spiegel did")
		})
	}
}

func TestSendPasswordsSignatureAllowList(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-Pa55"
	var gotUser, gotPass string
	var gotReq *http.Request
	var gotBody []byte
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotUser, gotPass, _ = r.BasicAuth()
		gotReq = r
		gotBody, _ = io.ReadAll(r.Body)
		w.WriteHeader(500)
	}))
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	file := filepath.Join(t.TempDir(), "pw.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"127.0.0.1": {"hook": "`+secret+`"}, "_secrets": {"hmac": "k", "hmac_old": "k0"}}`), 0o600))
	pw, err := passwords.Load(file)
	require.NoError(t, err)

	c := New(Config{Passwords: pw, SignatureSecrets: []string{"hmac", "hmac_old"}, AllowedHosts: loopback})
	body := []byte(`{"a":1}`)
	hookURL := "http://hook@" + u.Host + "/x?q=1"
	_, err = c.Send(t.Context(), Request{Method: "POST", URL: hookURL, Body: body})
	require.Error(t, err)
	assert.Equal(t, "hook", gotUser)
	assert.Equal(t, secret, gotPass)
	assert.Equal(t, body, gotBody)
	assert.NotContains(t, err.Error(), secret)
	// Signed with both secrets while they rotate: a receiver knowing either one accepts.
	assert.Len(t, strings.Split(gotReq.Header.Get(SignatureHeader), ","), 2)
	for _, key := range []string{"k", "k0"} {
		assert.NoError(t, signature.Verify(gotReq, gotBody, []byte(key)), "secret %s", key)
	}
	assert.ErrorIs(t, signature.Verify(gotReq, gotBody, []byte("other")), signature.ErrMismatch)

	// A transport error (closed port) must not quote the injected URL either.
	closed := httptest.NewServer(http.NotFoundHandler())
	closedURL := "http://hook@" + strings.TrimPrefix(closed.URL, "http://") + "/x"
	closed.Close()
	_, err = c.Send(t.Context(), Request{Method: "GET", URL: closedURL})
	require.Error(t, err)
	assert.NotContains(t, err.Error(), secret)

	denied := New(Config{Passwords: pw, AllowedHosts: []string{"api.example", "*.example.org"}})
	_, err = denied.Send(t.Context(), Request{Method: "GET", URL: hookURL})
	require.ErrorIs(t, err, ErrHostNotAllowed)
	assert.True(t, IsPermanent(err))

	unsigned := New(Config{SignatureSecrets: []string{"missing"}, AllowedHosts: loopback})
	_, err = unsigned.Send(t.Context(), Request{Method: "GET", URL: srv.URL})
	require.ErrorContains(t, err, "signature secret")
}

func TestSendRedirectOutsideAllowList(t *testing.T) {
	t.Parallel()
	other := newSink(t, func(int, *http.Request) int { return 200 })
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, strings.Replace(other.URL, "127.0.0.1", "localhost", 1)+"/y", http.StatusFound)
	}))
	defer s.Close()
	_, err := New(Config{AllowedHosts: loopback}).Send(t.Context(), Request{Method: "GET", URL: s.URL, FollowRedirects: true})
	require.ErrorIs(t, err, ErrHostNotAllowed)
	assert.True(t, IsPermanent(err))
	assert.Empty(t, other.paths(), "the redirect target was never called")
}

func TestSendTimeout(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer s.Close()
	defer close(release)
	start := time.Now()
	_, err := New(Config{Timeout: time.Hour, AllowedHosts: loopback}).Send(t.Context(), Request{Method: "GET", URL: s.URL, Timeout: 100 * time.Millisecond})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), 10*time.Second)
}

type countingRecorder struct{ statuses []int }

func (c *countingRecorder) Webhook(status int, _ time.Duration) {
	c.statuses = append(c.statuses, status)
}

func TestDeliverRetries(t *testing.T) {
	t.Parallel()
	fast := rules.RetryPolicy{Backoff: rules.BackoffLinear, BaseDelay: time.Millisecond, Limit: 3}

	t.Run("500 twice then 200", func(t *testing.T) {
		t.Parallel()
		s := newSink(t, func(n int, _ *http.Request) int { return map[bool]int{true: 500, false: 200}[n <= 2] })
		rec := &countingRecorder{}
		out := New(Config{Metrics: rec, AllowedHosts: loopback}).Deliver(t.Context(), Request{Method: "GET", URL: s.URL}, Retry{Policy: fast})
		require.NoError(t, out.Err)
		assert.Equal(t, 3, out.Attempts)
		assert.Equal(t, []int{500, 500, 200}, rec.statuses)
	})
	t.Run("limit reached after limit+1 attempts", func(t *testing.T) {
		t.Parallel()
		s := newSink(t, func(int, *http.Request) int { return 502 })
		out := New(Config{AllowedHosts: loopback}).Deliver(t.Context(), Request{Method: "GET", URL: s.URL}, Retry{Policy: fast})
		assert.True(t, out.GaveUp)
		assert.Equal(t, 4, out.Attempts)
		assert.Equal(t, 502, out.Status)
		assert.EqualValues(t, 4, s.n.Load())
	})
	t.Run("attempts of earlier runs count", func(t *testing.T) {
		t.Parallel()
		s := newSink(t, func(int, *http.Request) int { return 500 })
		out := New(Config{AllowedHosts: loopback}).Deliver(t.Context(), Request{Method: "GET", URL: s.URL}, Retry{Policy: fast, Done: 3})
		assert.True(t, out.GaveUp)
		assert.EqualValues(t, 1, s.n.Load())
	})
	t.Run("long delays are deferred, not waited for", func(t *testing.T) {
		t.Parallel()
		s := newSink(t, func(int, *http.Request) int { return 500 })
		slow := rules.RetryPolicy{Backoff: rules.BackoffExponential, BaseDelay: time.Hour, Multiplier: 2}
		out := New(Config{AllowedHosts: loopback}).Deliver(t.Context(), Request{Method: "GET", URL: s.URL}, Retry{Policy: slow, InlineMax: time.Second})
		assert.False(t, out.GaveUp)
		assert.GreaterOrEqual(t, out.RetryIn, time.Hour)
		assert.Equal(t, 1, out.Attempts)
	})
	t.Run("permanent errors are not retried", func(t *testing.T) {
		t.Parallel()
		out := New(Config{AllowedHosts: []string{"nowhere.example"}}).Deliver(t.Context(), Request{Method: "GET", URL: "http://127.0.0.1:1/"}, Retry{Policy: fast})
		assert.True(t, out.GaveUp)
		assert.Equal(t, 1, out.Attempts)
	})
	t.Run("ctx ending interrupts without giving up", func(t *testing.T) {
		t.Parallel()
		s := newSink(t, func(int, *http.Request) int { return 500 })
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		forever := rules.RetryPolicy{Backoff: rules.BackoffLinear, BaseDelay: 10 * time.Millisecond}
		out := New(Config{AllowedHosts: loopback}).Deliver(ctx, Request{Method: "GET", URL: s.URL}, Retry{Policy: forever})
		assert.False(t, out.GaveUp)
		assert.Error(t, out.Err)
		assert.Zero(t, out.RetryIn)
	})
}

// TestIdleConnectionsCoverParallelRequests: the default transport keeps an idle connection for
// every request the caller may run at once, so no request dials a connection that is closed
// after it.
func TestIdleConnectionsCoverParallelRequests(t *testing.T) {
	for parallel, want := range map[int]int{0: 64, 10: 64, 200: 200} {
		c := New(Config{MaxParallel: parallel})
		tr := c.tr
		assert.Equal(t, want, tr.MaxIdleConnsPerHost, "MaxParallel %d", parallel)
		assert.GreaterOrEqual(t, tr.MaxIdleConns, want)
	}
}

// TestSendInstanceHeader: with Config.Instance every attempt names the sending process in
// X-Spiegel-Instance; without it the header is absent. InstanceName ends in this process's pid.
func TestSendInstanceHeader(t *testing.T) {
	t.Parallel()
	got := make(chan []string, 2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Values(InstanceHeader)
	}))
	defer srv.Close()
	name := InstanceName()
	require.True(t, strings.HasSuffix(name, fmt.Sprintf("/%d", os.Getpid())), "instance name %q", name)
	_, err := New(Config{AllowedHosts: loopback, Instance: name}).Send(t.Context(), Request{Method: "GET", URL: srv.URL + "/x"})
	require.NoError(t, err)
	assert.Equal(t, []string{name}, <-got)
	_, err = New(Config{AllowedHosts: loopback}).Send(t.Context(), Request{Method: "GET", URL: srv.URL + "/x"})
	require.NoError(t, err)
	assert.Empty(t, <-got)
}
