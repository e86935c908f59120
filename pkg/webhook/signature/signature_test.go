package signature

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var (
	key    = []byte("k3y")
	oldKey = []byte("0ld")
	at     = time.Unix(1_767_225_600, 0)
)

// signed returns a server-side request as a receiver sees it, signed with secrets at ts.
func signed(method, target, delivery string, body []byte, ts int64, secrets ...[]byte) *http.Request {
	r := httptest.NewRequest(method, target, strings.NewReader(string(body)))
	r.Header.Set(TimestampHeader, strconv.FormatInt(ts, 10))
	r.Header.Set(DeliveryHeader, delivery)
	r.Header.Set(SignatureHeader, Sign(secrets, ts, method, target, delivery, body))
	return r
}

func TestMessageLayout(t *testing.T) {
	t.Parallel()
	got := Message(1767225600, "POST", "/hook/db1?id=a%2Fb", "d-1", []byte(`{"a":1}`))
	assert.Equal(t, "1767225600\nPOST\n/hook/db1?id=a%2Fb\nd-1\n{\"a\":1}", string(got))
	// The README's example, computed independently with
	// printf '1767225600\nPOST\n/hook/db1?id=a%%2Fb\nd-1\n{"a":1}' | openssl dgst -sha256 -hmac k3y
	assert.Equal(t, "v1=b171cae201fd5714e5726b36c82629011042f8abc9c71b23252c139e81e48a5b",
		Sign([][]byte{key}, 1767225600, "POST", "/hook/db1?id=a%2Fb", "d-1", []byte(`{"a":1}`)))
}

func TestVerify(t *testing.T) {
	t.Parallel()
	body := []byte(`{"change":1}`)
	v := Verifier{Secrets: [][]byte{key}, Now: func() time.Time { return at }}
	ok := func() *http.Request { return signed("POST", "/hook/db1?x=1", "d1", body, at.Unix(), key) }
	require.NoError(t, v.Verify(ok(), body))

	cases := []struct {
		name   string
		req    *http.Request
		body   []byte
		v      Verifier
		wantIs error
	}{
		{"other body", ok(), []byte(`{"change":2}`), v, ErrMismatch},
		{"other method", func() *http.Request { r := ok(); r.Method = "PUT"; return r }(), body, v, ErrMismatch},
		{"other query", func() *http.Request { r := ok(); r.RequestURI = "/hook/db1?x=2"; return r }(), body, v, ErrMismatch},
		{"other path", func() *http.Request { r := ok(); r.RequestURI = "/hook/db2?x=1"; return r }(), body, v, ErrMismatch},
		{"other delivery", func() *http.Request { r := ok(); r.Header.Set(DeliveryHeader, "d2"); return r }(), body, v, ErrMismatch},
		{"other timestamp within tolerance", func() *http.Request {
			r := ok()
			r.Header.Set(TimestampHeader, strconv.FormatInt(at.Unix()+1, 10))
			return r
		}(), body, v, ErrMismatch},
		{"other secret", signed("POST", "/hook/db1?x=1", "d1", body, at.Unix(), []byte("nope")), body, v, ErrMismatch},
		{"too old", signed("POST", "/h", "d1", body, at.Unix()-301, key), body, v, ErrExpired},
		{"too far ahead", signed("POST", "/h", "d1", body, at.Unix()+301, key), body, v, ErrExpired},
		{"no signature", func() *http.Request { r := ok(); r.Header.Del(SignatureHeader); return r }(), body, v, ErrMissing},
		{"no delivery", func() *http.Request { r := ok(); r.Header.Del(DeliveryHeader); return r }(), body, v, ErrMissing},
		{"bad timestamp", func() *http.Request { r := ok(); r.Header.Set(TimestampHeader, "+1767225600"); return r }(), body, v, ErrMissing},
		{"unknown scheme only", func() *http.Request {
			r := ok()
			r.Header.Set(SignatureHeader, strings.Replace(r.Header.Get(SignatureHeader), "v1=", "v0=", 1))
			return r
		}(), body, v, ErrMissing},
		{"no secret", ok(), body, Verifier{}, ErrNoSecret},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			assert.ErrorIs(t, tc.v.Verify(tc.req, tc.body), tc.wantIs)
		})
	}
}

func TestVerifyTolerance(t *testing.T) {
	t.Parallel()
	body := []byte("x")
	v := Verifier{Secrets: [][]byte{key}, Tolerance: 30 * time.Second, Now: func() time.Time { return at }}
	for skew, ok := range map[int64]bool{-30: true, 30: true, 0: true, -31: false, 31: false} {
		err := v.Verify(signed("GET", "/", "d", body, at.Unix()+skew, key), body)
		if ok {
			assert.NoError(t, err, "skew %ds", skew)
		} else {
			assert.ErrorIs(t, err, ErrExpired, "skew %ds", skew)
		}
	}
}

// TestRotation: while a secret rotates the sender signs with both; receivers that know only the
// old one, only the new one, or both all accept; the values may also come as separate headers.
func TestRotation(t *testing.T) {
	t.Parallel()
	r := signed("DELETE", "/h?id=1", "d", nil, at.Unix(), key, oldKey)
	assert.Regexp(t, `^v1=[0-9a-f]{64},v1=[0-9a-f]{64}$`, r.Header.Get(SignatureHeader))
	for _, secrets := range [][][]byte{{key}, {oldKey}, {oldKey, key}} {
		assert.NoError(t, Verifier{Secrets: secrets, Now: func() time.Time { return at }}.Verify(r, nil))
	}
	vals := strings.Split(r.Header.Get(SignatureHeader), ",")
	r.Header.Del(SignatureHeader)
	r.Header.Add(SignatureHeader, vals[0])
	r.Header.Add(SignatureHeader, " "+vals[1])
	assert.NoError(t, Verifier{Secrets: [][]byte{oldKey}, Now: func() time.Time { return at }}.Verify(r, nil))
}

func TestHandler(t *testing.T) {
	t.Parallel()
	var got string
	h := Verifier{Secrets: [][]byte{key}}.Handler(16, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got = string(b)
	}))
	now := time.Now().Unix()
	for _, tc := range []struct {
		req  *http.Request
		want int
		body string
	}{
		{signed("POST", "/h", "d", []byte("hello"), now, key), 200, "hello"},
		{signed("POST", "/h", "d", []byte("hello"), now, oldKey), 401, ""},
		{signed("POST", "/h", "d", []byte("0123456789abcdefg"), now, key), 413, ""},
	} {
		got = ""
		w := httptest.NewRecorder()
		h.ServeHTTP(w, tc.req)
		assert.Equal(t, tc.want, w.Code)
		assert.Equal(t, tc.body, got)
	}
}

// FuzzVerify feeds arbitrary header values: Verify must never panic and must accept only the
// genuine signature.
func FuzzVerify(f *testing.F) {
	f.Add("1767225600", "d", "v1=00,v1=zz, v2=1", "/x?y")
	f.Add("", "", "", "")
	f.Add("-1", "\n", "v1=", "/")
	f.Fuzz(func(t *testing.T, ts, delivery, sig, target string) {
		h := http.Header{}
		h.Set(TimestampHeader, ts)
		h.Set(DeliveryHeader, delivery)
		h.Set(SignatureHeader, sig)
		err := Verifier{Secrets: [][]byte{key}, Now: func() time.Time { return at }}.VerifyParts("GET", target, h, nil)
		if err == nil {
			n, _ := strconv.ParseInt(ts, 10, 64)
			if !strings.Contains(sig, Sign([][]byte{key}, n, "GET", target, delivery, nil)[3:]) {
				t.Fatalf("accepted a forged signature %q", sig)
			}
		}
	})
}
