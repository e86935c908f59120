package natstest

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// APICounter counts the JetStream API requests of an account by kind ("STREAM.PURGE",
// "STREAM.MSG.GET", "DIRECT.GET", "CONSUMER.MSG.NEXT", ...), as the server sees them: it
// subscribes to $JS.API.> on a connection of its own, so the requests of every other connection
// of the account count.
type APICounter struct {
	nc  *nats.Conn
	sub *nats.Subscription

	mu     sync.Mutex
	counts map[string]int
}

// apiKinds are the request kinds whose subject ends with one name (a stream) or two (stream and
// consumer), longest first.
var apiKinds = []string{
	"CONSUMER.MSG.NEXT", "STREAM.MSG.GET", "STREAM.MSG.DELETE", "DIRECT.GET",
	"STREAM.INFO", "STREAM.PURGE", "STREAM.NAMES", "STREAM.LIST", "STREAM.CREATE", "STREAM.UPDATE",
	"CONSUMER.INFO", "CONSUMER.CREATE", "CONSUMER.DURABLE.CREATE", "CONSUMER.DELETE", "INFO",
}

// APIKind returns the kind of the JetStream API request sent on subject.
func APIKind(subject string) string {
	rest := strings.TrimPrefix(subject, "$JS.API.")
	for _, k := range apiKinds {
		if rest == k || strings.HasPrefix(rest, k+".") {
			return k
		}
	}
	return rest
}

// NewAPICounter starts counting on its own connection to url (closed at the end of the test).
func NewAPICounter(t testing.TB, url string) *APICounter {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("natstest: api counter: connect: %v", err)
	}
	t.Cleanup(nc.Close)
	c := &APICounter{nc: nc, counts: map[string]int{}}
	sub, err := nc.Subscribe("$JS.API.>", func(m *nats.Msg) {
		c.mu.Lock()
		c.counts[APIKind(m.Subject)]++
		c.mu.Unlock()
	})
	if err != nil {
		t.Fatalf("natstest: api counter: subscribe: %v", err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatalf("natstest: api counter: flush: %v", err)
	}
	c.sub = sub
	return c
}

// Stop ends the count once every request sent so far reached the counter and was counted,
// closes its connection and returns the count.
func (c *APICounter) Stop(t testing.TB) map[string]int {
	t.Helper()
	// The flush's answer comes after every request the server passed on before it, so they are
	// all queued for the subscription; the barrier runs once the callback has counted them
	// (without it the unsubscribe dropped what was still queued: an empty count now and then).
	if err := c.nc.Flush(); err != nil {
		t.Fatalf("natstest: api counter: flush: %v", err)
	}
	counted := make(chan struct{})
	if err := c.nc.Barrier(func() { close(counted) }); err != nil {
		t.Fatalf("natstest: api counter: barrier: %v", err)
	}
	select {
	case <-counted:
	case <-time.After(30 * time.Second):
		t.Fatalf("natstest: api counter: the requests were not counted within 30 s")
	}
	if err := c.sub.Unsubscribe(); err != nil {
		t.Fatalf("natstest: api counter: unsubscribe: %v", err)
	}
	c.nc.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.counts))
	for k, v := range c.counts {
		out[k] = v
	}
	return out
}
