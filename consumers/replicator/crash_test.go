package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
)

// stallingProxy forwards every request to the test server except POST /_replicate, which it
// holds until the client goes away: to the replicator, a replication that never ends.
func (e *env) stallingProxy(t *testing.T) (started <-chan struct{}, proxyURL string) {
	t.Helper()
	target, err := url.Parse(e.Couch.URL)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: target.Scheme, Host: target.Host, Path: target.Path})
	ch := make(chan struct{})
	var once sync.Once
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/_replicate" {
			_, _ = io.Copy(io.Discard, r.Body) // only then does the server notice a client that hangs up
			once.Do(func() { close(ch) })
			<-r.Context().Done()
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { srv.CloseClientConnections(); srv.Close() })
	u, _ := url.Parse(srv.URL)
	u.User = target.User
	return ch, u.String()
}

// A replicator process killed with SIGKILL in the middle of a replication loses nothing: after
// AckWait the job goes to another instance, which replicates everything.
func TestSIGKILLMidReplicationAnotherInstanceCompletes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 3*time.Second)
	src, tgt := e.Prefix+"big", e.Prefix+"big_copy"
	e.Couch.CreateDB(t, src)
	e.Couch.CreateDB(t, tgt)
	bulkDocs(t, e.Couch, src, 0, 3000)
	e.Couch.Put(t, e.cfg.DBName, "big", map[string]any{"type": "replicator", "source": src, "target": tgt})

	started, proxyURL := e.stallingProxy(t)
	logsA := &syncBuffer{}
	a := e.startProcess(t, proxyURL, logsA)
	e.publish(t, src)
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatalf("instance A never started the replication; its logs:\n%s", spiegeltest.Tail(logsA.String(), 30))
	}
	// For longer than AckWait (3s), A's InProgress keeps the job its own: never redelivered.
	require.Never(t, func() bool { return e.redelivered(t) > 0 }, 4*time.Second, 100*time.Millisecond,
		"the job was redelivered while A was alive")
	require.Empty(t, revs(t, e.Couch, tgt), "the replication must still be running when A dies")
	require.NoError(t, a.Process.Kill())

	p := e.startReplicator(t, nil)
	waitConverged(t, e.Couch, src, tgt, 60*time.Second)
	attempts := p.attemptsOf(src)
	require.NotEmpty(t, attempts)
	assert.GreaterOrEqual(t, attempts[0], 2, "B ran the redelivered job")
	assert.Contains(t, logsA.String(), "replication starting")
}
