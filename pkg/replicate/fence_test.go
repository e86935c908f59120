package replicate

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// gate holds the first request whose path contains match until release is closed.
type gate struct {
	base    http.RoundTripper
	match   string
	once    sync.Once
	reached chan struct{}
	release chan struct{}
	puts    atomic.Int64 // _local PUTs sent through it
}

func newGate(match string) *gate {
	return &gate{base: &http.Transport{DisableCompression: true}, match: match, reached: make(chan struct{}), release: make(chan struct{})}
}

func (g *gate) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodPut && strings.Contains(req.URL.Path, "/_local/") {
		g.puts.Add(1)
	}
	if strings.Contains(req.URL.Path, g.match) {
		first := false
		g.once.Do(func() { first = true })
		if first {
			close(g.reached)
			select {
			case <-g.release:
			case <-req.Context().Done():
				return nil, req.Context().Err()
			}
		}
	}
	return g.base.RoundTrip(req)
}

// targetSession returns the session of the target's checkpoint of replication id.
func targetSession(t *testing.T, s *couchtest.Server, target, id string) string {
	t.Helper()
	var doc checkpointDoc
	require.NoError(t, s.Do(t, http.MethodGet, "/"+couchtest.PathDB(target)+"/_local/"+id, nil, &doc))
	return doc.SessionID
}

// TestStaleRunIsFenced: a run that read the checkpoints, then stalled (its lease ran out), while
// a newer run of the same replication did the work and checkpointed, cannot write its
// checkpoint over the newer one: its write is refused with ErrFenced, not retried over the new
// rev, and the newer run's checkpoint stays.
func TestStaleRunIsFenced(t *testing.T) {
	s := couchtest.Get(t)
	if !s.PouchDB {
		t.Skip("Apache CouchDB does not check the revs of _local docs: the rev is no fence there (see Options.Fence)")
	}
	source, target := s.NewDB(t, "fsrc_"), s.NewDB(t, "ftgt_")
	createDocs(t, s, source, "base", 10)
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target)}
	_, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	createDocs(t, s, source, "more", 5)

	g := newGate("/_changes")
	staleOpt := opt
	staleOpt.HTTPClient = &http.Client{Transport: g}
	staleDone := make(chan error, 1)
	var stale Result
	go func() {
		var err error
		stale, err = Run(t.Context(), staleOpt, testLog(t))
		staleDone <- err
	}()
	select {
	case <-g.reached: // the stale run has read both checkpoints
	case <-time.After(20 * time.Second):
		t.Fatal("the stale run never read changes")
	}
	newer, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	require.EqualValues(t, 5, newer.DocsWritten)
	close(g.release)
	select {
	case err = <-staleDone:
	case <-time.After(20 * time.Second):
		t.Fatal("the stale run did not end")
	}
	require.ErrorIs(t, err, ErrFenced)
	assert.NotEqual(t, newer.SessionID, stale.SessionID)
	assert.Equal(t, newer.SessionID, targetSession(t, s, target, newer.ReplicationID), "the newer run's checkpoint stays")
	requireSameLeaves(t, s, source, target)

	again, err := Run(context.Background(), opt, testLog(t))
	require.NoError(t, err)
	assert.True(t, again.NoChanges, "the next run starts from the newer checkpoint")
}

// memFence is a Fence in memory, as one NATS key-value entry per replication would be.
type memFence struct {
	mu     sync.Mutex
	tokens map[string]uint64
	seq    uint64
}

func (f *memFence) Token(_ context.Context, id string) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.tokens[id], nil
}

func (f *memFence) Advance(_ context.Context, id string, token uint64) (uint64, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.tokens[id] != token {
		return 0, false, nil
	}
	f.seq++
	if f.tokens == nil {
		f.tokens = map[string]uint64{}
	}
	f.tokens[id] = f.seq
	return f.seq, true, nil
}

// TestStaleRunIsFencedByTheFence: with a Fence, a stale run is refused before it writes its
// checkpoint on any server, Apache CouchDB included (which does not check _local revs): the
// newer run's checkpoint stays on both sides.
func TestStaleRunIsFencedByTheFence(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "fsrc_"), s.NewDB(t, "ftgt_")
	createDocs(t, s, source, "base", 10)
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), Fence: &memFence{}}
	_, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	createDocs(t, s, source, "more", 5)

	g := newGate("/_changes")
	staleOpt := opt
	staleOpt.HTTPClient = &http.Client{Transport: g}
	staleDone := make(chan error, 1)
	var stale Result
	go func() {
		var err error
		stale, err = Run(t.Context(), staleOpt, testLog(t))
		staleDone <- err
	}()
	select {
	case <-g.reached:
	case <-time.After(20 * time.Second):
		t.Fatal("the stale run never read changes")
	}
	newer, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	close(g.release)
	select {
	case err = <-staleDone:
	case <-time.After(20 * time.Second):
		t.Fatal("the stale run did not end")
	}
	require.ErrorIs(t, err, ErrFenced)
	assert.Zero(t, g.puts.Load(), "the stale run sent no checkpoint write")
	assert.Equal(t, newer.SessionID, targetSession(t, s, target, newer.ReplicationID))
	var src checkpointDoc
	require.NoError(t, s.Do(t, http.MethodGet, "/"+couchtest.PathDB(source)+"/_local/"+newer.ReplicationID, nil, &src))
	assert.Equal(t, newer.SessionID, src.SessionID)
	assert.NotEqual(t, stale.SessionID, src.SessionID)
}
