package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/webhook/signature"
)

// authProxy is a reverse proxy in front of the test CouchDB that answers 401 unless the request
// carries Basic auth user:password or the cookie of a session it opened for them (POST /_session
// with name and password, as CouchDB's own replicator authenticates), and forwards the requests
// it lets through with the test server's own credentials (those of COUCHDB_URL: CouchDB 3
// serves new dbs to admins only; PouchDB Server in admin party needs none). It counts the
// requests it let through and refused.
type authProxy struct {
	*httptest.Server
	mu                 sync.Mutex
	passed, refused    int
	refusedCredentials []string // "user:password" of refused requests that had Basic auth or a session body
	sessions           map[string]bool
}

func newAuthProxy(t testing.TB, couchURL, user, password string) *authProxy {
	t.Helper()
	target, err := url.Parse(couchURL)
	if err != nil {
		t.Fatalf("parse COUCHDB_URL: %v", err)
	}
	upstreamUser := target.User
	target.User = nil
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.ErrorLog = log.New(io.Discard, "", 0) // requests cut by stopping processes are expected
	p := &authProxy{sessions: map[string]bool{}}
	refuse := func(w http.ResponseWriter, credentials string) {
		p.mu.Lock()
		p.refused++
		if credentials != "" {
			p.refusedCredentials = append(p.refusedCredentials, credentials)
		}
		p.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("WWW-Authenticate", `Basic realm="couchdb"`)
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = io.WriteString(w, `{"error":"unauthorized","reason":"Name or password is incorrect."}`+"\n")
	}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/_session" {
			name, pw := sessionCredentials(r)
			if name != user || pw != password {
				refuse(w, name+":"+pw)
				return
			}
			token := fmt.Sprintf("%x", sha256.Sum256([]byte(fmt.Sprint(time.Now().UnixNano(), name))))
			p.mu.Lock()
			p.sessions[token] = true
			p.passed++
			p.mu.Unlock()
			http.SetCookie(w, &http.Cookie{Name: "AuthSession", Value: token, Path: "/", HttpOnly: true})
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"ok":true,"name":"`+name+`","roles":["_admin"]}`+"\n")
			return
		}
		u, pw, basic := r.BasicAuth()
		session := false
		if c, err := r.Cookie("AuthSession"); err == nil {
			p.mu.Lock()
			session = p.sessions[c.Value]
			p.mu.Unlock()
		}
		if !session && (!basic || u != user || pw != password) {
			credentials := ""
			if basic {
				credentials = u + ":" + pw
			}
			refuse(w, credentials)
			return
		}
		p.mu.Lock()
		p.passed++
		p.mu.Unlock()
		r.Header.Del("Authorization")
		r.Header.Del("Cookie")
		if upstreamUser != nil {
			upw, _ := upstreamUser.Password()
			r.SetBasicAuth(upstreamUser.Username(), upw)
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(p.Close)
	return p
}

// sessionCredentials reads name and password of a POST /_session body, form or JSON.
func sessionCredentials(r *http.Request) (name, password string) {
	body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	var j struct {
		Name     string `json:"name"`
		Password string `json:"password"`
	}
	if json.Unmarshal(body, &j) == nil && j.Name != "" {
		return j.Name, j.Password
	}
	form, err := url.ParseQuery(string(body))
	if err != nil {
		return "", ""
	}
	return form.Get("name"), form.Get("password")
}

// counts returns the requests let through and refused so far.
func (p *authProxy) counts() (passed, refused int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.passed, p.refused
}

// sawRefused reports whether a refused request carried Basic auth user:password.
func (p *authProxy) sawRefused(userPassword string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.refusedCredentials {
		if c == userPassword {
			return true
		}
	}
	return false
}

// hostPort is the proxy's "127.0.0.1:port".
func hostPort(s *httptest.Server) string {
	u, _ := url.Parse(s.URL)
	return u.Host
}

// hookCall is one request the webhook sink received.
type hookCall struct {
	Path, User, Password string
	Method, Target       string      // as received: what the signature covers
	Header               http.Header // as received
	At                   time.Time   // when it was received
	Body                 []byte
}

// hookSink is the webhook receiver: it answers 200 to requests with Basic auth user and one of
// the accepted passwords, 401 to the rest, and records every request.
type hookSink struct {
	*httptest.Server
	user string

	mu       sync.Mutex
	accepted map[string]bool
	calls    []hookCall
}

func newHookSink(t testing.TB, user string, passwords ...string) *hookSink {
	t.Helper()
	s := &hookSink{user: user, accepted: map[string]bool{}}
	for _, p := range passwords {
		s.accepted[p] = true
	}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c := hookCall{Path: r.URL.Path, Method: r.Method, Target: r.RequestURI, Header: r.Header.Clone(), At: time.Now()}
		c.User, c.Password, _ = r.BasicAuth()
		c.Body, _ = io.ReadAll(r.Body)
		s.mu.Lock()
		s.calls = append(s.calls, c)
		ok := c.User == s.user && s.accepted[c.Password]
		s.mu.Unlock()
		if !ok {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(s.Close)
	return s
}

// accept adds a password the sink accepts.
func (s *hookSink) accept(password string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.accepted[password] = true
}

// all returns the calls received so far.
func (s *hookSink) all() []hookCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]hookCall(nil), s.calls...)
}

// signedWith reports whether c carries a valid X-Spiegel-Signature under key, as a receiver
// checks it when the call arrives (package signature: timestamp within 5 minutes, method,
// target, delivery id, body).
func (c hookCall) signedWith(key string) bool {
	v := signature.Verifier{Secrets: [][]byte{[]byte(key)}, Now: func() time.Time { return c.At }}
	return v.VerifyParts(c.Method, c.Target, c.Header, c.Body) == nil
}

// bodyHas reports whether the call's body contains s.
func (c hookCall) bodyHas(s string) bool { return bytes.Contains(c.Body, []byte(s)) }

// freeAddr returns a loopback address that was free a moment ago: for listeners of child
// processes (which do not report the port they chose), and as an address where nothing listens.
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}
