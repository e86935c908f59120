package main

import (
	"bytes"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/spiegel-nats/spiegel/pkg/healthtest"
)

// `producer healthcheck` probes the producer's own /healthz (SPIEGEL_HTTP_ADDR) without loading
// the rest of the configuration: it is what the container health check runs.
func TestHealthcheckCommand(t *testing.T) {
	hz := healthtest.NewHealthz(t)
	t.Setenv("SPIEGEL_HTTP_ADDR", hz.Addr)
	t.Setenv("SPIEGEL_COUCHDB_URL", "") // required by every other command
	var out bytes.Buffer
	assert.Equal(t, 0, realMain(t.Context(), []string{"healthcheck"}, nil, &out, &out), out.String())
	hz.SetStatus(http.StatusServiceUnavailable)
	assert.Equal(t, 1, realMain(t.Context(), []string{"healthcheck"}, nil, &out, &out))
	assert.Contains(t, out.String(), "producer healthcheck: ")
	assert.Equal(t, int32(2), hz.Probes())
	out.Reset()
	assert.Equal(t, 0, realMain(t.Context(), []string{"healthcheck", "--help"}, nil, &out, &out))
	assert.Contains(t, out.String(), "producer healthcheck [URL]")
}
