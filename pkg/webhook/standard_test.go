package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/passwords"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/webhook/signature"
)

// The signing secrets of these tests, as the passwords file holds them: the new one in the
// Standard Webhooks form, the old one in another form (used as its bytes).
var (
	stdNewKey    = []byte("the new key: 32 random bytes...!")
	stdNewSecret = "whsec_" + base64.StdEncoding.EncodeToString(stdNewKey)
	stdOldSecret = "an old raw secret"
)

// received is one request a capture server got.
type received struct {
	method, target string
	header         http.Header
	body           []byte
}

// captureServer records every request and answers status(n) to the n-th (1-based).
type captureServer struct {
	*httptest.Server
	mu  sync.Mutex
	got []received
}

func newCaptureServer(t *testing.T, status func(n int) int) *captureServer {
	s := &captureServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.got = append(s.got, received{method: r.Method, target: r.RequestURI, header: r.Header.Clone(), body: body})
		n := len(s.got)
		s.mu.Unlock()
		w.WriteHeader(status(n))
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *captureServer) requests() []received {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]received(nil), s.got...)
}

// secretsFile writes a passwords file whose "_secrets" are secrets and loads it.
func secretsFile(t *testing.T, secrets map[string]string) *passwords.File {
	t.Helper()
	var b strings.Builder
	b.WriteString(`{"_secrets": {`)
	first := true
	for name, value := range secrets {
		if !first {
			b.WriteString(",")
		}
		first = false
		b.WriteString(`"` + name + `": "` + value + `"`)
	}
	b.WriteString(`}}`)
	file := filepath.Join(t.TempDir(), "pw.json")
	require.NoError(t, os.WriteFile(file, []byte(b.String()), 0o600))
	pw, err := passwords.Load(file)
	require.NoError(t, err)
	return pw
}

// verifiers are Standard Webhooks verifiers of the official Go library for the new secret (as
// a whsec_ secret), the old one (raw bytes) and a secret Spiegel does not have.
func verifiers(t *testing.T) (newer, older, stranger *standardwebhooks.Webhook) {
	t.Helper()
	var err error
	newer, err = standardwebhooks.NewWebhook(stdNewSecret)
	require.NoError(t, err)
	older, err = standardwebhooks.NewWebhookRaw([]byte(stdOldSecret))
	require.NoError(t, err)
	stranger, err = standardwebhooks.NewWebhook("whsec_" + base64.StdEncoding.EncodeToString([]byte("somebody else's key")))
	require.NoError(t, err)
	return newer, older, stranger
}

// readmeVerify is the receiver of consumers/onchange/README.md ("Standard Webhooks"), written
// from the spec with the standard library only: the tests check that it agrees with the official
// library, so that the example stays right.
func readmeVerify(h http.Header, body, key []byte) bool {
	ts := h.Get("webhook-timestamp")
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || time.Since(time.Unix(sec, 0)).Abs() > 5*time.Minute {
		return false // too old (a replay) or a wrong clock
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte(h.Get("webhook-id") + "." + ts + "." + string(body)))
	want := "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))
	return slices.ContainsFunc(strings.Fields(h.Get("webhook-signature")), func(sig string) bool {
		return hmac.Equal([]byte(sig), []byte(want))
	})
}

func TestBuildCopiesSigning(t *testing.T) {
	t.Parallel()
	for _, signing := range []string{rules.SigningV1, rules.SigningStandard, rules.SigningBoth} {
		req, err := Build(mustRule(t, map[string]any{"url": "http://h/x", "signing": signing}), vars("db", map[string]any{"_id": "a", "_rev": "1-a"}))
		require.NoError(t, err)
		assert.Equal(t, signing, req.Signing)
	}
	req, err := Build(mustRule(t, map[string]any{"url": "http://h/x"}), vars("db", map[string]any{"_id": "a", "_rev": "1-a"}))
	require.NoError(t, err)
	assert.Equal(t, rules.SigningV1, req.Signing, "the default")
}

// TestStandardSigning: a rule's "signing" decides the header sets a request carries. What the
// client sends verifies with the official Standard Webhooks library under either secret of a
// rotation (and with package signature for v1), and fails with another secret or another body;
// v1 requests carry no Standard Webhooks header, standard requests no X-Spiegel one.
func TestStandardSigning(t *testing.T) {
	t.Parallel()
	newer, older, stranger := verifiers(t)
	pw := secretsFile(t, map[string]string{"new": stdNewSecret, "old": stdOldSecret})
	v1Verifier := signature.Verifier{Secrets: [][]byte{[]byte(stdNewSecret), []byte(stdOldSecret)}}
	doc := map[string]any{"_id": "doc/1", "_rev": "1-a"}

	for _, tt := range []struct {
		signing      string
		v1, standard bool
	}{
		{rules.SigningV1, true, false},
		{rules.SigningStandard, false, true},
		{rules.SigningBoth, true, true},
	} {
		t.Run(tt.signing, func(t *testing.T) {
			t.Parallel()
			srv := newCaptureServer(t, func(int) int { return 200 })
			c := New(Config{Passwords: pw, SignatureSecrets: []string{"new", "old"}, AllowedHosts: loopback})
			rule := mustRule(t, map[string]any{"url": srv.URL + "/hook/${db_name}?x=1", "method": "POST",
				"params": map[string]any{"id": "$change.id", "db": "$db_name"}, "signing": tt.signing})
			req, err := Build(rule, vars("db1", doc))
			require.NoError(t, err)
			_, err = c.Send(t.Context(), req)
			require.NoError(t, err)
			got := srv.requests()
			require.Len(t, got, 1)
			r := got[0]
			require.NotEmpty(t, r.body)

			v1Err := v1Verifier.VerifyParts(r.method, r.target, r.header, r.body)
			if tt.v1 {
				assert.NoError(t, v1Err)
				assert.Equal(t, req.Delivery, r.header.Get(DeliveryHeader))
				assert.Len(t, strings.Split(r.header.Get(SignatureHeader), ","), 2)
			} else {
				assert.ErrorIs(t, v1Err, signature.ErrMissing)
				for _, h := range []string{TimestampHeader, DeliveryHeader, SignatureHeader} {
					assert.Empty(t, r.header.Values(h), h)
				}
			}
			if !tt.standard {
				for _, h := range []string{StandardIDHeader, StandardTimestampHeader, StandardSignatureHeader} {
					assert.Empty(t, r.header.Values(h), h)
				}
				assert.ErrorIs(t, newer.Verify(r.body, r.header), standardwebhooks.ErrRequiredHeaders)
				return
			}
			assert.Equal(t, req.Delivery, r.header.Get(StandardIDHeader), "webhook-id is the delivery id")
			assert.Regexp(t, `^v1,\S+ v1,\S+$`, r.header.Get(StandardSignatureHeader), "one signature per secret")
			assert.NoError(t, newer.Verify(r.body, r.header), "the new secret, decoded from whsec_")
			assert.NoError(t, older.Verify(r.body, r.header), "the old secret, as its bytes")
			assert.True(t, readmeVerify(r.header, r.body, stdNewKey), "the README's receiver, new secret")
			assert.True(t, readmeVerify(r.header, r.body, []byte(stdOldSecret)), "the README's receiver, old secret")
			assert.False(t, readmeVerify(r.header, r.body, []byte(stdNewSecret)), "a whsec_ secret is not the key as written")
			assert.ErrorIs(t, stranger.Verify(r.body, r.header), standardwebhooks.ErrNoMatchingSignature)
			altered := []byte(strings.Replace(string(r.body), "doc/1", "doc/2", 1))
			require.NotEqual(t, r.body, altered)
			assert.ErrorIs(t, newer.Verify(altered, r.header), standardwebhooks.ErrNoMatchingSignature)
			assert.False(t, readmeVerify(r.header, altered, stdNewKey))
			if tt.v1 {
				assert.Equal(t, r.header.Get(TimestampHeader), r.header.Get(StandardTimestampHeader), "one timestamp for both schemes")
			}
		})
	}
}

// TestStandardSigningOneSecret: with one secret, one signature, which only that secret verifies.
func TestStandardSigningOneSecret(t *testing.T) {
	t.Parallel()
	newer, older, _ := verifiers(t)
	srv := newCaptureServer(t, func(int) int { return 200 })
	c := New(Config{Passwords: secretsFile(t, map[string]string{"new": stdNewSecret}), SignatureSecrets: []string{"new"}, AllowedHosts: loopback})
	_, err := c.Send(t.Context(), Request{Method: "PUT", URL: srv.URL + "/x", Body: []byte(`{"a":1}`), Signing: rules.SigningStandard})
	require.NoError(t, err)
	r := srv.requests()[0]
	assert.Regexp(t, `^v1,[A-Za-z0-9+/]{43}=$`, r.header.Get(StandardSignatureHeader))
	assert.NoError(t, newer.Verify(r.body, r.header))
	assert.ErrorIs(t, older.Verify(r.body, r.header), standardwebhooks.ErrNoMatchingSignature)
}

// TestStandardTimestamp: webhook-timestamp is the time of the attempt, so that a receiver refuses
// a request older than its tolerance (5 minutes in the library), while the signature itself
// still matches; every attempt of a request carries the same webhook-id, and another change
// another one.
func TestStandardTimestamp(t *testing.T) {
	t.Parallel()
	newer, _, _ := verifiers(t)
	pw := secretsFile(t, map[string]string{"new": stdNewSecret})
	srv := newCaptureServer(t, func(n int) int { return map[bool]int{true: 503, false: 200}[n <= 2] })
	c := New(Config{Passwords: pw, SignatureSecrets: []string{"new"}, AllowedHosts: loopback})
	old := time.Now().Add(-10 * time.Minute)
	c.now = func() time.Time { return old }
	rule := mustRule(t, map[string]any{"url": srv.URL + "/x", "method": "POST", "params": "$change.id", "signing": "standard"})
	req, err := Build(rule, vars("db1", map[string]any{"_id": "a", "_rev": "1-a"}))
	require.NoError(t, err)
	out := c.Deliver(t.Context(), req, Retry{Policy: rules.RetryPolicy{Backoff: rules.BackoffLinear, BaseDelay: time.Millisecond, Limit: 5}})
	require.NoError(t, out.Err)
	got := srv.requests()
	require.Len(t, got, 3)
	for i, r := range got {
		assert.Equal(t, req.Delivery, r.header.Get(StandardIDHeader), "attempt %d", i)
		assert.ErrorIs(t, newer.Verify(r.body, r.header), standardwebhooks.ErrMessageTooOld, "attempt %d", i)
		assert.NoError(t, newer.VerifyIgnoringTimestamp(r.body, r.header), "attempt %d: only the timestamp is wrong", i)
		assert.False(t, readmeVerify(r.header, r.body, stdNewKey), "attempt %d: the README's receiver refuses it too", i)
	}

	other, err := Build(rule, vars("db1", map[string]any{"_id": "b", "_rev": "1-b"}))
	require.NoError(t, err)
	c.now = time.Now
	_, err = c.Send(t.Context(), other)
	require.NoError(t, err)
	got = srv.requests()
	require.Len(t, got, 4)
	assert.NotEqual(t, req.Delivery, got[3].header.Get(StandardIDHeader))
	assert.NoError(t, newer.Verify(got[3].body, got[3].header), "a fresh request verifies")
}

// TestStandardBadWhsecSecret: a secret written whsec_ whose rest is not base64 fails a
// standard-signed attempt before anything is sent, naming the secret and never quoting it; v1
// rules keep using it as its bytes.
func TestStandardBadWhsecSecret(t *testing.T) {
	t.Parallel()
	const bad = "whsec_not*base64"
	srv := newCaptureServer(t, func(int) int { return 200 })
	c := New(Config{Passwords: secretsFile(t, map[string]string{"hmac": bad}), SignatureSecrets: []string{"hmac"}, AllowedHosts: loopback})
	for _, signing := range []string{rules.SigningStandard, rules.SigningBoth} {
		_, err := c.Send(t.Context(), Request{Method: "GET", URL: srv.URL + "/x", Signing: signing})
		require.ErrorIs(t, err, signature.ErrStandardSecret, signing)
		assert.Contains(t, err.Error(), `"hmac"`)
		assert.NotContains(t, err.Error(), "not*base64")
		assert.False(t, IsPermanent(err), "fixing the passwords file fixes it")
	}
	assert.Empty(t, srv.requests(), "never sent unsigned")

	_, err := c.Send(t.Context(), Request{Method: "GET", URL: srv.URL + "/x", Signing: rules.SigningV1})
	require.NoError(t, err)
	got := srv.requests()
	require.Len(t, got, 1)
	assert.NoError(t, signature.Verifier{Secrets: [][]byte{[]byte(bad)}}.VerifyParts(got[0].method, got[0].target, got[0].header, got[0].body))
}

// TestStandardRedirects: within the first request's origin a redirected request is signed again
// (a 303 turns it into a GET without a body: the signature covers the empty body); on another
// host it keeps its webhook-id and webhook-timestamp but carries no signature.
func TestStandardRedirects(t *testing.T) {
	t.Parallel()
	newer, _, _ := verifiers(t)
	var mu sync.Mutex
	var got []received
	var port string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, received{method: r.Method, target: r.RequestURI, header: r.Header.Clone(), body: body})
		mu.Unlock()
		switch r.URL.Path {
		case "/start":
			http.Redirect(w, r, "/same", http.StatusSeeOther)
		case "/same":
			http.Redirect(w, r, "http://b.test:"+port+"/away", http.StatusTemporaryRedirect)
		}
	}))
	defer srv.Close()
	_, port, _ = net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
	res := resolving(map[string][]string{"a.test": {"127.0.0.1"}, "b.test": {"127.0.0.1"}})
	c := New(Config{Passwords: secretsFile(t, map[string]string{"new": stdNewSecret}), SignatureSecrets: []string{"new"},
		AllowedHosts: []string{"a.test", "b.test"}, Resolver: res})
	_, err := c.Send(t.Context(), Request{Method: "POST", URL: "http://a.test:" + port + "/start", Body: []byte(`{"a":1}`),
		Delivery: "d-1", FollowRedirects: true, Signing: rules.SigningStandard})
	require.NoError(t, err)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, got, 3)
	start, same, away := got[0], got[1], got[2]
	assert.NoError(t, newer.Verify(start.body, start.header))
	assert.Equal(t, "GET", same.method)
	assert.Empty(t, same.body)
	assert.NoError(t, newer.Verify(same.body, same.header), "signed again for the body it has")
	assert.NotEqual(t, start.header.Get(StandardSignatureHeader), same.header.Get(StandardSignatureHeader))
	assert.Empty(t, away.header.Values(StandardSignatureHeader), "no signature another host could replay")
	assert.Equal(t, "d-1", away.header.Get(StandardIDHeader))
	assert.Equal(t, start.header.Get(StandardTimestampHeader), away.header.Get(StandardTimestampHeader))
	assert.ErrorIs(t, newer.Verify(away.body, away.header), standardwebhooks.ErrRequiredHeaders)
}
