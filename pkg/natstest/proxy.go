package natstest

import (
	"bufio"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Proxy is a TCP proxy in front of the server that a test controls, to play the network faults
// a real server cannot be asked for: Freeze stops every byte in both directions while the
// connections stay open (a partition: neither side sees a close), Thaw lets the held bytes
// through again, Cut resets the open connections. New connections made while frozen are
// accepted and frozen too.
type Proxy struct {
	target string
	ln     net.Listener

	mu     sync.Mutex
	thawed chan struct{} // closed while not frozen
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
	held   atomic.Int64 // bytes read while frozen and not passed on yet

	rewrite func(reply string) string // see RewriteReplies
}

// NewProxy starts a proxy to s on a free loopback port; it is closed when the test ends.
func (s *Server) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("natstest: proxy listen: %v", err)
	}
	addr, ok := s.Server.Addr().(*net.TCPAddr)
	if !ok {
		t.Fatalf("natstest: proxy: server address %v", s.Server.Addr())
	}
	thawed := make(chan struct{})
	close(thawed)
	p := &Proxy{target: addr.String(), ln: ln, thawed: thawed, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(p.Close)
	return p
}

// HeldBytes returns how many bytes the proxy holds because it is frozen: a test waits for a
// client's publish to be on its way before it thaws.
func (p *Proxy) HeldBytes() int64 { return p.held.Load() }

// URL is the client URL of the server through the proxy.
func (p *Proxy) URL() string { return "nats://" + p.ln.Addr().String() }

// RewriteReplies makes the proxy pass each message the server sends with its reply subject
// replaced by f(reply), to play what a real server reports only under load or in a cluster (an
// ack reply whose pending count says 0 before the last message, say). It applies to
// connections made after the call.
func (p *Proxy) RewriteReplies(f func(reply string) string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rewrite = f
}

// ZeroPendingAt is a RewriteReplies function: the message delivered dseq-th by any consumer of
// stream reports 0 messages pending after it, as a clustered JetStream under load can report
// before the last one. Ack replies of other streams pass unchanged.
func ZeroPendingAt(stream string, dseq int) func(reply string) string {
	d := strconv.Itoa(dseq)
	return func(reply string) string {
		// $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>
		tok := strings.Split(reply, ".")
		if len(tok) != 9 || tok[0] != "$JS" || tok[1] != "ACK" || tok[2] != stream || tok[6] != d {
			return reply
		}
		tok[8] = "0"
		return strings.Join(tok, ".")
	}
}

// Freeze holds every byte in both directions from now on; the connections stay open.
func (p *Proxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.thawed:
		p.thawed = make(chan struct{})
	default: // frozen already
	}
}

// Thaw lets the held bytes through and the connections run again.
func (p *Proxy) Thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.thawed:
	default:
		close(p.thawed)
	}
}

// Cut closes every open connection (both sides see a reset); new ones are accepted.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}

// Close stops the proxy: the listener and every connection are closed, held bytes dropped.
func (p *Proxy) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		_ = p.ln.Close()
		for c := range p.conns {
			_ = c.Close()
		}
		select {
		case <-p.thawed:
		default:
			close(p.thawed)
		}
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Go(func() { p.pipe(c) })
	}
}

// track adds c to the open connections; false when the proxy is closed.
func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
		_ = c.Close()
	}
}

// gate returns a channel that is closed while the proxy is not frozen.
func (p *Proxy) gate() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.thawed
}

func (p *Proxy) pipe(c net.Conn) {
	<-p.gate() // a connection made while frozen stays silent until the thaw
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	if !p.track(c, up) {
		_ = c.Close()
		_ = up.Close()
		return
	}
	defer p.untrack(c, up)
	done := make(chan struct{}, 2)
	go func() { p.copy(up, c); done <- struct{}{} }()
	go func() {
		if f := p.rewriter(); f != nil {
			p.copyRewriting(c, up, f)
		} else {
			p.copy(c, up)
		}
		done <- struct{}{}
	}()
	<-done
}

func (p *Proxy) rewriter() func(string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rewrite
}

// copy moves bytes from src to dst, holding each read while the proxy is frozen.
func (p *Proxy) copy(dst io.Writer, src io.Reader) {
	buf := make([]byte, 32*1024)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if werr := p.pass(dst, buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// pass writes b to dst once the proxy is not frozen.
func (p *Proxy) pass(dst io.Writer, b []byte) error {
	gate := p.gate()
	select {
	case <-gate:
	default:
		p.held.Add(int64(len(b)))
		<-gate
		p.held.Add(-int64(len(b)))
	}
	_, err := dst.Write(b)
	return err
}

// copyRewriting moves the server's protocol from src to dst a line at a time, with the reply
// subject of each MSG and HMSG replaced by f(reply) (see RewriteReplies).
func (p *Proxy) copyRewriting(dst io.Writer, src io.Reader, f func(string) string) {
	r := bufio.NewReaderSize(src, 64*1024)
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return
		}
		out := []byte(line)
		if fields := strings.Fields(line); len(fields) > 0 && (fields[0] == "MSG" || fields[0] == "HMSG") {
			withReply := 5 // MSG <subject> <sid> <reply> <size>
			if fields[0] == "HMSG" {
				withReply = 6 // HMSG <subject> <sid> <reply> <header size> <total size>
			}
			if len(fields) == withReply {
				fields[3] = f(fields[3])
			}
			size, err := strconv.Atoi(fields[len(fields)-1])
			if err != nil {
				return
			}
			payload := make([]byte, size+2) // and its CRLF
			if _, err := io.ReadFull(r, payload); err != nil {
				return
			}
			out = append([]byte(strings.Join(fields, " ")+"\r\n"), payload...)
		}
		if err := p.pass(dst, out); err != nil {
			return
		}
	}
}
