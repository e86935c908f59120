package chaos

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"syscall"
	"testing"
	"time"
)

// TestOutageProxy: the proxy forwards to the server; an outage cuts an open connection and
// refuses new ones for its down time; afterwards the same address serves again.
func TestOutageProxy(t *testing.T) {
	hold := make(chan struct{})
	arrived := make(chan struct{}, 1) // the held request reached the server through the proxy
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			arrived <- struct{}{}
			<-hold
		}
		_, _ = io.WriteString(w, "ok")
	}))
	defer srv.Close()
	defer close(hold)
	u, _ := url.Parse(srv.URL)
	p, err := startOutageProxy(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	base, err := p.url("http://admin:pw@" + u.Host)
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
	get := func(path string) error {
		resp, err := client.Get(base + path)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, err = io.ReadAll(resp.Body)
		return err
	}
	if err := get("/"); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}

	held := make(chan error, 1)
	go func() { held <- get("/hold") }()
	select { // the outage must cut an open request, not refuse a new one
	case <-arrived:
	case err := <-held:
		t.Fatalf("the held request ended before the outage: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("the held request did not reach the server")
	}
	done := make(chan error, 1)
	go func() { done <- p.outage(context.Background(), time.Second) }()
	select {
	case err := <-held:
		if err == nil {
			t.Fatal("the open request survived the outage")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the outage did not cut the open connection")
	}
	if err := get("/"); err == nil {
		t.Fatal("a new connection was served during the outage")
	}
	if err := <-done; err != nil {
		t.Fatalf("outage: %v", err)
	}
	if err := get("/"); err != nil {
		t.Fatalf("after the outage: %v", err)
	}
}

// echoServer accepts TCP connections and sends back every byte it reads; every byte it received
// is also reported on got. It also writes what push receives to the last connection.
type echoServer struct {
	ln   net.Listener
	got  chan []byte
	push chan []byte
}

func startEcho(t *testing.T) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &echoServer{ln: ln, got: make(chan []byte, 100), push: make(chan []byte, 10)}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				stop := make(chan struct{})
				defer close(stop)
				go func() {
					for {
						select {
						case b := <-s.push:
							_, _ = c.Write(b)
						case <-stop:
							return
						}
					}
				}()
				buf := make([]byte, 1024)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						s.got <- append([]byte(nil), buf[:n]...)
						_, _ = c.Write(buf[:n])
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return s
}

// readN reads exactly n bytes from c within d.
func readN(c net.Conn, n int, d time.Duration) ([]byte, error) {
	_ = c.SetReadDeadline(time.Now().Add(d))
	defer c.SetReadDeadline(time.Time{})
	buf := make([]byte, n)
	_, err := io.ReadFull(c, buf)
	return buf, err
}

// quiet is how long the freeze tests watch for a byte that must not move: a bounded window,
// since the absence of an event cannot be waited for otherwise.
const quiet = 500 * time.Millisecond

// echoThroughProxy starts an echo server, an outage proxy in front of it and a connection
// through the proxy that has sent "a"; the proxy and the connection are closed when the test ends.
func echoThroughProxy(t *testing.T) (*echoServer, *outageProxy, net.Conn) {
	t.Helper()
	srv := startEcho(t)
	p, err := startOutageProxy(srv.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.close)
	c, err := net.Dial("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if _, err := c.Write([]byte("a")); err != nil {
		t.Fatal(err)
	}
	return srv, p, c
}

// TestProxyFreeze: during a freeze no byte moves either way (the server receives nothing the
// client sends, the client nothing the server sends) and the connection stays open (a read
// times out, it does not end); after the freeze everything held arrives, in order, on the same
// connection. A connection opened during the freeze is served once it ends.
func TestProxyFreeze(t *testing.T) {
	srv, p, c := echoThroughProxy(t)
	if b, err := readN(c, 1, 5*time.Second); err != nil || string(b) != "a" {
		t.Fatalf("before the freeze: %q, %v", b, err)
	}
	<-srv.got

	p.freeze()
	if _, err := c.Write([]byte("bc")); err != nil {
		t.Fatalf("a write during the freeze failed (the connection must stay open): %v", err)
	}
	srv.push <- []byte("x")
	select {
	case b := <-srv.got:
		t.Fatalf("the server received %q during the freeze", b)
	case <-time.After(quiet):
	}
	b, err := readN(c, 1, quiet)
	var ne net.Error
	if err == nil {
		t.Fatalf("the client received %q during the freeze", b)
	}
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("the connection ended during the freeze (%v): a freeze keeps it open", err)
	}
	late, err := net.Dial("tcp", p.addr) // accepted by the kernel, served after the freeze
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	if _, err := late.Write([]byte("L")); err != nil {
		t.Fatal(err)
	}
	if b, err := readN(late, 1, quiet); err == nil {
		t.Fatalf("a connection opened during the freeze was served: %q", b)
	}

	p.thaw()
	var got []byte
	for len(got) < 3 {
		select {
		case b := <-srv.got:
			got = append(got, b...)
		case <-time.After(5 * time.Second):
			t.Fatalf("after the freeze the server got only %q", got)
		}
	}
	if string(got) != "bcL" && string(got) != "Lbc" {
		t.Fatalf("after the freeze the server got %q, want bc and L", got)
	}
	b, err = readN(c, 3, 5*time.Second) // "x" pushed during the freeze, then the echo of "bc"
	if err != nil || (string(b) != "xbc" && string(b) != "bcx") {
		t.Fatalf("after the freeze the client read %q, %v", b, err)
	}
	if b, err := readN(late, 1, 5*time.Second); err != nil || string(b) != "L" {
		t.Fatalf("the connection opened during the freeze, after it: %q, %v", b, err)
	}
}

// TestProxyCut: a cut resets open connections at once (the client's read fails with an error,
// not a timeout), resets new ones for its down time while the port stays open, and serves
// again afterwards.
func TestProxyCut(t *testing.T) {
	_, p, c := echoThroughProxy(t)
	if _, err := readN(c, 1, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.cutFor(ctx, time.Hour) }()
	_, err := readN(c, 1, 5*time.Second)
	var ne net.Error
	if err == nil || errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the open connection was not cut: %v", err)
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("the open connection ended with %v, want a reset", err)
	}
	n, err := net.Dial("tcp", p.addr) // the port stays open: the kernel accepts, the proxy resets
	if err == nil {
		defer n.Close()
		if _, err = readN(n, 1, 5*time.Second); err == nil || errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("a connection opened during the cut was not reset: %v", err)
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cutFor: %v", err)
	}
	c2, err := net.Dial("tcp", p.addr)
	if err != nil {
		t.Fatalf("after the cut: %v", err)
	}
	defer c2.Close()
	if _, err := c2.Write([]byte("z")); err != nil {
		t.Fatal(err)
	}
	if b, err := readN(c2, 1, 5*time.Second); err != nil || string(b) != "z" {
		t.Fatalf("after the cut: %q, %v", b, err)
	}
}
