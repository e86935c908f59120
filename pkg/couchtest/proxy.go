package couchtest

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
)

// Proxy is a TCP proxy in front of the test server that a test can cut and restore, to make the
// server "unreachable" without stopping it (a fault a real server cannot be asked for).
type Proxy struct {
	target string
	addr   string

	mu         sync.Mutex
	ln         net.Listener
	conns      map[net.Conn]struct{}
	open, peak int // client connections piped now, and the most at once
}

// NewProxy starts a proxy to the server and returns it; URL() is the server URL through it.
func (s *Server) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	u, err := url.Parse(s.URL)
	if err != nil {
		t.Fatalf("couchtest: parse URL: %v", err)
	}
	p := &Proxy{target: u.Host, conns: map[net.Conn]struct{}{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("couchtest: proxy listen: %v", err)
	}
	p.addr = ln.Addr().String()
	p.serve(ln)
	t.Cleanup(p.Cut)
	return p
}

// URL returns serverURL with its host replaced by the proxy's address.
func (p *Proxy) URL(serverURL string) string {
	u, _ := url.Parse(serverURL)
	u.Host = p.addr
	return u.String()
}

func (p *Proxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.pipe(c)
		}
	}()
}

func (p *Proxy) pipe(c net.Conn) {
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	if p.ln == nil {
		p.mu.Unlock()
		c.Close()
		up.Close()
		return
	}
	p.conns[c], p.conns[up] = struct{}{}, struct{}{}
	p.open++
	p.peak = max(p.peak, p.open)
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
	c.Close()
	up.Close()
	p.mu.Lock()
	if _, ok := p.conns[c]; ok {
		p.open--
	}
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// Open returns the client connections the proxy pipes now.
func (p *Proxy) Open() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.open
}

// Peak returns the most client connections the proxy piped at once.
func (p *Proxy) Peak() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.peak
}

// Cut closes the listener and every open connection: clients see refused connections.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		c.Close()
	}
	p.conns = map[net.Conn]struct{}{}
	p.open = 0
}

// Restore listens again on the same address.
func (p *Proxy) Restore(t testing.TB) {
	t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		t.Fatalf("couchtest: proxy relisten on %s: %v", p.addr, err)
	}
	p.serve(ln)
}
