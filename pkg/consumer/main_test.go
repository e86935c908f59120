package consumer_test

import (
	"bytes"
	"context"
	"net/http"
	"testing"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"

	"github.com/spiegel-nats/spiegel/pkg/healthtest"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/consumer"
)

// `replicator healthcheck` and `onchange healthcheck` probe the binary's own listener
// (SPIEGEL_HTTP_ADDR) and neither load the rest of the configuration nor run the consumer.
func TestMainHealthcheck(t *testing.T) {
	hz := healthtest.NewHealthz(t)
	t.Setenv("SPIEGEL_HTTP_ADDR", hz.Addr)
	t.Setenv("SPIEGEL_COUCHDB_URL", "") // required: Load would fail, the probe does not read it
	run := func(context.Context, *logrus.Logger) error {
		t.Error("healthcheck ran the consumer")
		return nil
	}
	for name, cfg := range map[string]consumer.Spec{"replicator": &config.Replicator{}, "onchange": &config.OnChange{}} {
		var stdout, stderr bytes.Buffer
		hz.SetStatus(http.StatusOK)
		assert.Equal(t, 0, consumer.Main(t.Context(), name, "usage", []string{"healthcheck"}, &stdout, &stderr, cfg, run), stderr.String())
		hz.SetStatus(http.StatusInternalServerError)
		assert.Equal(t, 1, consumer.Main(t.Context(), name, "usage", []string{"healthcheck"}, &stdout, &stderr, cfg, run))
		assert.Contains(t, stderr.String(), name+" healthcheck: ")
		assert.Contains(t, stderr.String(), "500 Internal Server Error")
	}
	assert.Equal(t, int32(4), hz.Probes(), "every probe asked /healthz")
}
