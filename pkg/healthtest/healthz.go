package healthtest

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// Healthz is a listener whose /healthz answers the status a test sets (200 at first) and
// counts the probes it got: what a `healthcheck` command is tested against.
type Healthz struct {
	Addr          string // host:port, for SPIEGEL_HTTP_ADDR
	status, asked atomic.Int32
}

// NewHealthz starts a Healthz, closed when the test ends.
func NewHealthz(t testing.TB) *Healthz {
	t.Helper()
	h := &Healthz{}
	h.status.Store(http.StatusOK)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			h.asked.Add(1)
		}
		w.WriteHeader(int(h.status.Load()))
	}))
	t.Cleanup(srv.Close)
	h.Addr = strings.TrimPrefix(srv.URL, "http://")
	return h
}

// SetStatus makes every later answer code.
func (h *Healthz) SetStatus(code int) { h.status.Store(int32(code)) }

// Probes returns how many requests asked /healthz.
func (h *Healthz) Probes() int32 { return h.asked.Load() }
