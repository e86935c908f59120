package chaos

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"sync"
	"time"
)

// outageProxy is a TCP proxy the run controls, between a Spiegel process and a server. It
// plays three faults on every connection through it:
//
//   - outage (a restart as the processes see one): every connection is cut and new ones are
//     refused (the listener is closed) for the down time, then the proxy listens on the same port
//     again. It stands between the Spiegel processes and an external CouchDB
//     (CHAOS_COUCHDB_URL) that the run must not restart: the server itself, and the writer and
//     the oracle, which talk to it directly, are untouched.
//   - freeze (a partition that drops packets): no byte moves either way, connections stay open,
//     new connections are accepted by the kernel but not served, until the freeze ends; then
//     everything held is passed on, in order.
//   - cut (a partition that resets): every connection is reset (RST) and new ones are reset at
//     once, for the down time; the listener stays open.
//
// Every product process reaches each NATS node and CouchDB through its own proxies (links.go),
// so a partition separates one process from one kind of server.
type outageProxy struct {
	addr     string // host:port the proxy listens on
	upstream string // host:port of the server

	mu       sync.Mutex
	ln       net.Listener // nil during an outage
	conns    map[net.Conn]struct{}
	frozen   chan struct{} // non-nil while frozen; closed when the freeze ends
	resetNew bool          // during a cut: new connections are reset at once
	closed   bool
	wg       sync.WaitGroup
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
// proxy cuts both. A connection accepted during a freeze dials the server only once the freeze
// ends (as a SYN lost in a partition); one accepted during a cut is reset at once.
func (p *outageProxy) pipe(c net.Conn) {
	p.waitThawed()
	p.mu.Lock()
	reset := p.resetNew || p.closed
	p.mu.Unlock()
	if reset {
		resetConn(c)
		return
	}
	up, err := net.DialTimeout("tcp", p.upstream, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	if p.ln == nil || p.resetNew || p.closed { // an outage or a cut began meanwhile
		p.mu.Unlock()
		resetConn(c)
		resetConn(up)
		return
	}
	p.conns[c], p.conns[up] = struct{}{}, struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		p.copy(dst, src)
		done <- struct{}{}
	}
	go cp(up, c)
	go cp(c, up)
	<-done
	// During a cut the other side is reset too, not closed: a cut that reset one side first
	// would otherwise end the pipe with a FIN on the other before the cut got to it.
	p.mu.Lock()
	cutting := p.resetNew
	p.mu.Unlock()
	if cutting {
		resetConn(c)
		resetConn(up)
	} else {
		_ = c.Close()
		_ = up.Close()
	}
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// copy copies src to dst until either fails. While the proxy is frozen it neither reads nor
// writes: what src sent stays in the kernel's buffers (the sender's writes block once they are
// full), and what was read just before the freeze is held until it ends.
func (p *outageProxy) copy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		p.waitThawed()
		n, err := src.Read(buf)
		if n > 0 {
			p.waitThawed()
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // pipe closes both sides
		}
	}
}

// waitThawed returns at once, or when the current freeze ends.
func (p *outageProxy) waitThawed() {
	p.mu.Lock()
	ch := p.frozen
	p.mu.Unlock()
	if ch != nil {
		<-ch
	}
}

// freeze stops every byte through the proxy, both ways, keeping every connection open, until
// thaw.
func (p *outageProxy) freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.frozen == nil && !p.closed {
		p.frozen = make(chan struct{})
	}
}

// thaw ends a freeze: what was held is passed on.
func (p *outageProxy) thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.frozen != nil {
		close(p.frozen)
		p.frozen = nil
	}
}

// freezeFor freezes the proxy for down (or until ctx ends).
func (p *outageProxy) freezeFor(ctx context.Context, down time.Duration) error {
	p.freeze()
	defer p.thaw()
	return sleepCtx(ctx, down)
}

// cutFor resets every connection and resets new ones at once for down (or until ctx ends);
// the listener stays open.
func (p *outageProxy) cutFor(ctx context.Context, down time.Duration) error {
	p.startCut()
	defer p.endCut()
	return sleepCtx(ctx, down)
}

// startCut resets every connection and makes new ones reset at once, until endCut.
func (p *outageProxy) startCut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resetNew = true
	p.resetAllLocked()
}

// endCut ends a cut: new connections are served again.
func (p *outageProxy) endCut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resetNew = false
}

// resetAllLocked resets every open connection (both sides of each pipe).
func (p *outageProxy) resetAllLocked() {
	for c := range p.conns {
		resetConn(c)
	}
}

// resetConn closes c with an RST (SO_LINGER 0) instead of a FIN.
func resetConn(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
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

// close ends the proxy (a freeze included) and waits for its goroutines.
func (p *outageProxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.thaw()
	p.cut()
	p.wg.Wait()
}
