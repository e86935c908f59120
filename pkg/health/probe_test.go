package health

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestHealthzURL(t *testing.T) {
	for addr, want := range map[string]string{
		":8080":           "http://127.0.0.1:8080/healthz",
		"0.0.0.0:8081":    "http://127.0.0.1:8081/healthz",
		"[::]:8082":       "http://127.0.0.1:8082/healthz",
		"127.0.0.2:9000":  "http://127.0.0.2:9000/healthz",
		"[::1]:9001":      "http://[::1]:9001/healthz",
		"spiegel-p0:8080": "http://spiegel-p0:8080/healthz",
	} {
		got, err := HealthzURL(addr)
		require.NoError(t, err, addr)
		assert.Equal(t, want, got, addr)
	}
	_, err := HealthzURL("")
	require.ErrorContains(t, err, "SPIEGEL_HTTP_ADDR is empty")
	_, err = HealthzURL("8080")
	require.ErrorContains(t, err, `SPIEGEL_HTTP_ADDR "8080"`)
}

// TestProbeCommand probes a running health server through its listener address, as the
// container health check does, then the same port once the server has stopped.
func TestProbeCommand(t *testing.T) {
	s := New("127.0.0.1:0", nil, nil, logrus.New())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	addr := s.Addr()
	require.NotEmpty(t, addr)

	var stdout, stderr bytes.Buffer
	assert.Equal(t, 0, ProbeCommand(t.Context(), "replicator", nil, addr, &stdout, &stderr), stderr.String())
	assert.Equal(t, 0, ProbeCommand(t.Context(), "replicator", []string{"http://" + addr + "/healthz"}, "", &stdout, &stderr), stderr.String())

	cancel()
	require.NoError(t, <-done)
	stderr.Reset()
	assert.Equal(t, 1, ProbeCommand(t.Context(), "replicator", nil, addr, &stdout, &stderr), "nothing listens any more")
	assert.Contains(t, stderr.String(), "replicator healthcheck:")

	stderr.Reset()
	assert.Equal(t, 2, ProbeCommand(t.Context(), "onchange", nil, "", &stdout, &stderr))
	assert.Contains(t, stderr.String(), "onchange healthcheck: SPIEGEL_HTTP_ADDR is empty")
	assert.Equal(t, 2, ProbeCommand(t.Context(), "onchange", []string{"a", "b"}, addr, &stdout, &stderr))
	assert.Equal(t, 0, ProbeCommand(t.Context(), "onchange", []string{"--help"}, addr, &stdout, &stderr))
	assert.Contains(t, stdout.String(), "onchange healthcheck [URL]")
}

func TestProbeNeedsA2xx(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	u := strings.Replace(srv.URL, "http://", "http://admin:Probe-secret@", 1) + "/healthz"
	var stdout, stderr bytes.Buffer
	assert.Equal(t, 1, ProbeCommand(t.Context(), "producer", []string{u}, "", &stdout, &stderr))
	assert.Contains(t, stderr.String(), "503 Service Unavailable")
	assert.NotContains(t, stderr.String(), "Probe-secret", "the URL's password stays out of the message")
}

// TestProbeGivesUpOnAHungListener: a listener that accepts and never answers fails the probe at
// its deadline instead of hanging the health check.
func TestProbeGivesUpOnAHungListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c
		}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	err = Probe(ctx, "http://"+ln.Addr().String()+"/healthz")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	select {
	case c := <-accepted:
		_ = c.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("the probe never reached the listener")
	}
}
