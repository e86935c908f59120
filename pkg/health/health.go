// Package health serves /healthz (the process is alive), /readyz (its dependencies answer) and
// Prometheus /metrics on one listener, and probes /healthz for the binaries' healthcheck command.
package health

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// Check reports whether one dependency is usable; it must honour ctx.
type Check func(ctx context.Context) error

// Server is the health and metrics endpoint of one process.
type Server struct {
	addr   string
	mux    *http.ServeMux
	log    logrus.FieldLogger
	checks map[string]Check

	mu       sync.Mutex
	listener net.Listener
	ready    chan struct{}
}

// checkTimeout bounds one evaluation of the readiness checks.
const checkTimeout = 3 * time.Second

// New returns a server for addr with the given readiness checks (name → check). When reg is not
// nil, it also gets the gauge spiegel_ready{check} (1 ready, 0 not), evaluated at each scrape with
// the checks of /readyz, so that alerts need not probe /readyz themselves.
func New(addr string, reg *prometheus.Registry, checks map[string]Check, log logrus.FieldLogger) *Server {
	s := &Server{addr: addr, mux: http.NewServeMux(), log: log, checks: checks, ready: make(chan struct{})}
	if reg != nil {
		reg.MustRegister(readyCollector{s})
	}
	s.mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"ok"}` + "\n"))
	})
	s.mux.HandleFunc("/readyz", s.readyz)
	if reg != nil {
		s.mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	}
	return s
}

func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	results, ok := s.evaluate(r.Context())
	w.Header().Set("Content-Type", "application/json")
	if !ok {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"ready": ok, "checks": results})
}

// evaluate runs every check at once, within checkTimeout, and returns "ok" or the (redacted)
// error of each, and whether all are ok.
func (s *Server) evaluate(ctx context.Context) (map[string]string, bool) {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	names := make([]string, 0, len(s.checks))
	for n := range s.checks {
		names = append(names, n)
	}
	sort.Strings(names)
	results := make(map[string]string, len(names))
	var mu sync.Mutex
	var wg sync.WaitGroup
	ok := true
	for _, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := "ok"
			if err := s.checks[n](ctx); err != nil {
				res = logging.RedactText(err.Error())
			}
			mu.Lock()
			results[n] = res
			if res != "ok" {
				ok = false
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	return results, ok
}

// readyDesc describes spiegel_ready.
var readyDesc = prometheus.NewDesc("spiegel_ready", "1 when the readiness check passes (as /readyz), 0 when it fails.", []string{"check"}, nil)

// readyCollector exports the readiness checks as spiegel_ready{check}.
type readyCollector struct{ s *Server }

func (c readyCollector) Describe(ch chan<- *prometheus.Desc) { ch <- readyDesc }

func (c readyCollector) Collect(ch chan<- prometheus.Metric) {
	results, _ := c.s.evaluate(context.Background())
	for name, res := range results {
		v := 0.0
		if res == "ok" {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(readyDesc, prometheus.GaugeValue, v, name)
	}
}

// Addr returns the address the server listens on once Run has started listening.
func (s *Server) Addr() string {
	<-s.ready
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.listener == nil {
		return ""
	}
	return s.listener.Addr().String()
}

// Run serves until ctx ends. An empty address disables the server (Run just waits for ctx).
func (s *Server) Run(ctx context.Context) error {
	if s.addr == "" {
		close(s.ready)
		<-ctx.Done()
		return nil
	}
	ln, err := net.Listen("tcp", s.addr)
	if err != nil {
		close(s.ready)
		return err
	}
	s.mu.Lock()
	s.listener = ln
	s.mu.Unlock()
	close(s.ready)
	return serve(ctx, ln, s.mux)
}

// serve serves h on ln until ctx ends, then shuts the server down (2 s for requests in flight).
func serve(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		shutCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutCtx)
		if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
}
