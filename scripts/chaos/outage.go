package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"sync"
	"time"
)

// outageProxy stands between the Spiegel processes and an external CouchDB (CHAOS_COUCHDB_URL)
// that the run must not restart: it is shared, and restarting it would break whoever else uses
// it. The restart fault then plays a restart as the processes see one: every connection through
// the proxy is cut and new ones are refused (the listener is closed) for the down time, then the
// proxy listens on the same port again. The server itself, and the writer and the oracle, which
// talk to it directly, are untouched: writes go on during the outage, as they would on the other
// nodes of a cluster.
type outageProxy struct {
	addr     string // host:port the proxy listens on
	upstream string // host:port of the server

	mu    sync.Mutex
	ln    net.Listener // nil during an outage
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// startOutageProxy listens on a free loopback port and forwards every connection to upstream.
func startOutageProxy(upstream string) (*outageProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &outageProxy{addr: ln.Addr().String(), upstream: upstream, conns: map[net.Conn]struct{}{}}
	p.serve(ln)
	return p, nil
}

// url returns server (a URL with credentials) with its host replaced by the proxy's.
func (p *outageProxy) url(server string) (string, error) {
	u, err := url.Parse(server)
	if err != nil {
		return "", errors.New("CHAOS_COUCHDB_URL does not parse") // never print the URL: it has the password
	}
	u.Host = p.addr
	return u.String(), nil
}

func (p *outageProxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Go(func() { p.pipe(c) })
		}
	})
}

// pipe copies between c and a new connection to the server until either side ends or the
// proxy cuts both.
func (p *outageProxy) pipe(c net.Conn) {
	up, err := net.DialTimeout("tcp", p.upstream, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	if p.ln == nil { // an outage began meanwhile
		p.mu.Unlock()
		_ = c.Close()
		_ = up.Close()
		return
	}
	p.conns[c], p.conns[up] = struct{}{}, struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		done <- struct{}{}
	}
	go cp(up, c)
	go cp(c, up)
	<-done
	_ = c.Close()
	_ = up.Close()
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// outage cuts every connection, refuses new ones for down, and listens again on the same
// address.
func (p *outageProxy) outage(ctx context.Context, down time.Duration) error {
	p.cut()
	werr := sleepCtx(ctx, down)
	var ln net.Listener
	err := waitUntil(context.Background(), 10*time.Second, 50*time.Millisecond, "the proxy's port free again", func() bool {
		var err error
		ln, err = net.Listen("tcp", p.addr)
		return err == nil
	})
	if err != nil {
		return fmt.Errorf("proxy: listen on %s again: %w", p.addr, err)
	}
	p.serve(ln)
	return werr
}

// cut closes the listener and every connection.
func (p *outageProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		_ = c.Close()
	}
}

// close ends the proxy and waits for its goroutines.
func (p *outageProxy) close() {
	p.cut()
	p.wg.Wait()
}
