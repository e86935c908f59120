package main

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
)

// `producer healthcheck` probes the producer's own /healthz (SPIEGEL_HTTP_ADDR) without loading
// the rest of the configuration: it is what the container health check runs.
func TestHealthcheckCommand(t *testing.T) {
	var status atomic.Int32
	status.Store(http.StatusOK)
	var asked atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			asked.Add(1)
		}
		w.WriteHeader(int(status.Load()))
	}))
	defer srv.Close()
	t.Setenv("SPIEGEL_HTTP_ADDR", strings.TrimPrefix(srv.URL, "http://"))
	t.Setenv("SPIEGEL_COUCHDB_URL", "") // required by every other command
	var out bytes.Buffer
	assert.Equal(t, 0, realMain(t.Context(), []string{"healthcheck"}, nil, &out, &out), out.String())
	status.Store(http.StatusServiceUnavailable)
	assert.Equal(t, 1, realMain(t.Context(), []string{"healthcheck"}, nil, &out, &out))
	assert.Contains(t, out.String(), "producer healthcheck: ")
	assert.Equal(t, int32(2), asked.Load())
	out.Reset()
	assert.Equal(t, 0, realMain(t.Context(), []string{"healthcheck", "--help"}, nil, &out, &out))
	assert.Contains(t, out.String(), "producer healthcheck [URL]")
}
