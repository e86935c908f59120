package webhook

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/passwords"
)

// BenchmarkSend measures one webhook attempt (Client.Send: URL checks, password injection,
// headers, signature, the request) to a local server that answers at once, next to the same
// POST sent by a bare http.Client over a pool of the same size, in the same run: ratio is
// Send's time per request over the bare POST's (1 would be no cost of its own). Cases: a URL
// without a user, and one whose user's password comes from the passwords file (as the on_change
// rules of an operator who keeps passwords out of rule docs).
func BenchmarkSend(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
	}))
	b.Cleanup(srv.Close)
	pwFile := filepath.Join(b.TempDir(), "passwords.json")
	host := strings.TrimPrefix(srv.URL, "http://")
	require.NoError(b, os.WriteFile(pwFile, []byte(`{"`+host+`": {"hook": "s3cret"}, "_secrets": {"hmac": "k"}}`), 0o600))
	pw, err := passwords.Load(pwFile)
	require.NoError(b, err)
	body := bytes.Repeat([]byte("x"), 300)
	for _, c := range []struct {
		name, url string
	}{
		{"plain", srv.URL + "/hook/db"},
		{"injected", "http://hook@" + host + "/hook/db"},
	} {
		b.Run(c.name, func(b *testing.B) {
			client := New(Config{AllowedHosts: loopback, Passwords: pw, SignatureSecrets: []string{"hmac"}, Instance: "bench", Timeout: 5 * time.Second})
			bare := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			var sendDur, bareDur time.Duration
			for b.Loop() {
				start := time.Now()
				_, err := client.Send(b.Context(), Request{Method: http.MethodPost, URL: c.url, Body: body})
				sendDur += time.Since(start)
				require.NoError(b, err)
				start = time.Now()
				resp, err := bare.Post(srv.URL+"/hook/db", "application/json", bytes.NewReader(body))
				require.NoError(b, err)
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				bareDur += time.Since(start)
			}
			b.ReportMetric(float64(sendDur.Nanoseconds())/float64(b.N), "send_ns/req")
			b.ReportMetric(float64(bareDur.Nanoseconds())/float64(b.N), "bare_ns/req")
			b.ReportMetric(float64(sendDur)/float64(bareDur), "ratio")
		})
	}
}
