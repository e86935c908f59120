package healthtest

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/health"
)

func TestParse(t *testing.T) {
	t.Parallel()
	text := `# HELP x_total Things.
# TYPE x_total counter
x_total{class="2xx",a="q\"uote"} 3
x_total{a="b",class="5xx"} 1
plain 2.5
h_bucket{le="+Inf"} 7
`
	s, err := Parse(strings.NewReader(text))
	require.NoError(t, err)
	assert.Equal(t, 3.0, s.Get("x_total", "class", "2xx", "a", `q"uote`))
	assert.Equal(t, 1.0, s.Get("x_total", "class", "5xx", "a", "b"))
	assert.Equal(t, 2.5, s.Get("plain"))
	assert.Equal(t, 7.0, s.Get("h_bucket", "le", "+Inf"))
	assert.False(t, s.Has("x_total", "class", "4xx", "a", "b"))

	for _, bad := range []string{"novalue", `x{a="b" 1`, `x{a=b} 1`, "x one"} {
		_, err := Parse(strings.NewReader(bad))
		assert.Error(t, err, bad)
	}
}

// The helpers read a real health server: scrape, readiness both ways.
func TestAgainstHealthServer(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "t_total", Help: "t"}, []string{"result"})
	reg.MustRegister(c)
	c.WithLabelValues("ok").Add(4)
	var down atomic.Bool
	addr := FreeAddr(t)
	srv := health.New(addr, reg, map[string]health.Check{"dep": func(context.Context) error {
		if down.Load() {
			return errors.New("dep is down")
		}
		return nil
	}}, logrus.New())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	WaitReady(t, addr, http.StatusOK, 5*time.Second)
	assert.Equal(t, 4.0, Scrape(t, addr).Get("t_total", "result", "ok"))
	down.Store(true)
	r := WaitReady(t, addr, http.StatusServiceUnavailable, 5*time.Second)
	assert.False(t, r.Ready)
	assert.Equal(t, "dep is down", r.Checks["dep"])
	status, err := GetStatus(addr, "/healthz")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, status)
}
