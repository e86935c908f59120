package chaos

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
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
