package health

import (
	"context"
	"net"
	"net/http"
	"net/http/pprof"
)

// RunPprof serves Go's profiling endpoints (/debug/pprof/: CPU, heap, goroutine, mutex and
// block profiles, traces) on addr until ctx ends: SPIEGEL_PPROF_ADDR, off when addr is empty.
// The endpoints have no authentication and a CPU profile costs the process while it runs, so
// this listener is opt-in and apart from the health and metrics one.
func RunPprof(ctx context.Context, addr string) error {
	if addr == "" {
		return nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return serve(ctx, ln, mux)
}
