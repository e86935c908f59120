// Package natstest runs a real nats-server with JetStream inside the test process.
package natstest

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/freeport"
)

// Server is an embedded nats-server with JetStream on a random loopback port and a temporary
// store. It is shut down when the test ends.
type Server struct {
	*server.Server
	opts *server.Options
}

// SyncEnv names the variable that sets the JetStream storage sync of every server Start starts,
// to measure its cost with the benchmarks: "always" (fsync after every write) or a duration (the
// flush interval, nats-server's sync_interval); unset, the server's default (2 minutes).
const SyncEnv = "SPIEGEL_TEST_NATS_SYNC"

// storageSync sets opts' storage sync from v (see SyncEnv).
func storageSync(opts *server.Options, v string) error {
	switch v {
	case "":
	case "always":
		opts.SyncAlways = true
	default:
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return fmt.Errorf("%s=%q: want \"always\" or a positive duration", SyncEnv, v)
		}
		opts.SyncInterval = d
	}
	return nil
}

// Start starts a server for t. Options may adjust the server options before start.
func Start(t testing.TB, options ...func(*server.Options)) *Server {
	t.Helper()
	// The client port is named, not drawn by the kernel: a restart (StartAgain) binds it again,
	// and a port of the kernel's choosing could be taken meanwhile (see package freeport).
	ports, err := freeport.Ports(1)
	if err != nil {
		t.Fatalf("natstest: %v", err)
	}
	opts := &server.Options{
		Host:      "127.0.0.1",
		Port:      ports[0],
		JetStream: true,
		StoreDir:  t.TempDir(),
		NoLog:     true,
		NoSigs:    true,
	}
	if err := storageSync(opts, os.Getenv(SyncEnv)); err != nil {
		t.Fatalf("natstest: %v", err)
	}
	for _, o := range options {
		o(opts)
	}
	s := &Server{opts: opts}
	s.start(t)
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	return s
}

func (s *Server) start(t testing.TB) {
	t.Helper()
	srv, err := server.NewServer(s.opts)
	if err != nil {
		t.Fatalf("natstest: new server: %v", err)
	}
	go srv.Start()
	// A restart (StartAgain) recovers the store first, which a loaded machine may take a while.
	if !srv.ReadyForConnections(30 * time.Second) {
		t.Fatalf("natstest: server not ready within 30s")
	}
	s.Server = srv
}

// URL is the client URL of the server.
func (s *Server) URL() string { return s.ClientURL() }

// Restart stops the server and starts it again on the same port with the same store, so that
// streams and consumers survive, as a NATS restart in production would.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	s.StartAgain(t)
}

// Stop shuts the server down and waits until it is gone, keeping its port and store for
// StartAgain: clients see NATS down until then. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	if addr, ok := s.Server.Addr().(*net.TCPAddr); ok {
		s.opts.Port = addr.Port
	}
	s.Shutdown()
	s.WaitForShutdown()
}

// StartAgain starts a server stopped by Stop on the same port with the same store, so that
// streams and consumers survive and clients reconnect to the same URL.
func (s *Server) StartAgain(t testing.TB) {
	t.Helper()
	s.start(t)
}

// Connect returns a NATS connection and a JetStream handle for the server, closed at the end of
// the test.
func (s *Server) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return connect(t, s.URL())
}

// Connect is Server.Connect through the proxy.
func (p *Proxy) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return connect(t, p.URL())
}

func connect(t testing.TB, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("natstest: connect: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("natstest: jetstream: %v", err)
	}
	return nc, js
}

// Answers sends an empty request on subject and returns the non-empty answers that came within
// within, or as soon as want of them came (a request many services answer, such as $SRV.PING).
func Answers(t testing.TB, nc *nats.Conn, subject string, want int, within time.Duration) [][]byte {
	t.Helper()
	inbox := nc.NewRespInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatalf("subscribe %s: %v", inbox, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest(subject, inbox, nil); err != nil {
		t.Fatalf("request %s: %v", subject, err)
	}
	var out [][]byte
	deadline := time.Now().Add(within)
	for len(out) < want {
		m, err := sub.NextMsg(time.Until(deadline))
		if err != nil {
			break
		}
		if len(m.Data) > 0 {
			out = append(out, m.Data)
		}
	}
	return out
}

// StartCluster starts a JetStream cluster of n servers (n1, n2, ...) routed to each other on
// loopback, each with its own temporary store, and waits until it has a meta leader. The
// servers are shut down when the test ends.
func StartCluster(t testing.TB, n int) []*Server {
	t.Helper()
	ports, err := freeport.Ports(n) // each node's routes name the others' ports before they listen
	if err != nil {
		t.Fatalf("natstest: cluster ports: %v", err)
	}
	servers := make([]*Server, n)
	for i := range servers {
		var routes []*url.URL
		for j, p := range ports {
			if j != i {
				routes = append(routes, &url.URL{Scheme: "nats-route", Host: fmt.Sprintf("127.0.0.1:%d", p)})
			}
		}
		servers[i] = Start(t, func(o *server.Options) {
			o.ServerName = fmt.Sprintf("n%d", i+1)
			o.Cluster = server.ClusterOpts{Name: "spiegel-test", Host: "127.0.0.1", Port: ports[i]}
			o.Routes = routes
		})
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, s := range servers {
			if s.JetStreamIsLeader() {
				return servers
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("natstest: the cluster of %d servers has no JetStream meta leader after 30s", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
