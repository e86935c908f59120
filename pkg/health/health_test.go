package health

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReadyzFollowsChecks(t *testing.T) {
	var down atomic.Bool
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "spiegel_test_total", Help: "x"})
	reg.MustRegister(c)
	c.Add(3)
	s := New("127.0.0.1:0", reg, map[string]Check{
		"couchdb": func(context.Context) error {
			if down.Load() {
				return errors.New("get http://admin:SECRETPW@127.0.0.1:1/: refused")
			}
			return nil
		},
	}, logrus.New())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	base := "http://" + s.Addr()

	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, _ := get("/healthz")
	assert.Equal(t, 200, code)
	code, _ = get("/readyz")
	assert.Equal(t, 200, code)
	_, body := get("/metrics")
	assert.Contains(t, body, `spiegel_ready{check="couchdb"} 1`)
	down.Store(true)
	code, body = get("/readyz")
	assert.Equal(t, 503, code)
	assert.Contains(t, body, "couchdb")
	assert.NotContains(t, body, "SECRETPW")
	_, body = get("/metrics")
	assert.Contains(t, body, `spiegel_ready{check="couchdb"} 0`, "the gauge follows the check")
	down.Store(false)
	code, _ = get("/readyz")
	assert.Equal(t, 200, code)
	_, body = get("/metrics")
	assert.Contains(t, body, "spiegel_test_total 3")
	assert.Contains(t, body, `spiegel_ready{check="couchdb"} 1`)
	cancel()
	require.NoError(t, <-done)
}
