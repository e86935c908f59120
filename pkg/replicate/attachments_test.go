package replicate

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// requestLog records the method, path and content type of every request sent through it.
type requestLog struct {
	base     http.RoundTripper
	mu       sync.Mutex
	reqs     []string
	inFlight int  // requests sent whose response body is not closed yet
	peak     int  // the most in flight at once since the last take
	queries  bool // record each request's query after its path
}

func (l *requestLog) RoundTrip(req *http.Request) (*http.Response, error) {
	l.mu.Lock()
	path := req.URL.Path
	if l.queries && req.URL.RawQuery != "" {
		path += "?" + req.URL.RawQuery
	}
	l.reqs = append(l.reqs, req.Method+" "+path+" "+req.Header.Get("Content-Type"))
	l.inFlight++
	l.peak = max(l.peak, l.inFlight)
	l.mu.Unlock()
	resp, err := l.base.RoundTrip(req)
	if err != nil {
		l.done()
		return nil, err
	}
	resp.Body = &loggedBody{ReadCloser: resp.Body, done: l.done}
	return resp, nil
}

func (l *requestLog) done() {
	l.mu.Lock()
	l.inFlight--
	l.mu.Unlock()
}

// loggedBody tells its requestLog when the response is closed (once).
type loggedBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *loggedBody) Close() error {
	b.once.Do(b.done)
	return b.ReadCloser.Close()
}

// takePeak returns the most requests in flight at once since the last call, and starts again.
func (l *requestLog) takePeak() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.peak
	l.peak = l.inFlight
	return p
}

// take returns the requests recorded since the last take.
func (l *requestLog) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.reqs
	l.reqs = nil
	return out
}

func count(reqs []string, match func(string) bool) int {
	n := 0
	for _, r := range reqs {
		if match(r) {
			n++
		}
	}
	return n
}

func randomBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}

func inlineAttachment(data []byte) map[string]any {
	return map[string]any{"content_type": "application/octet-stream", "data": base64.StdEncoding.EncodeToString(data)}
}

// attachmentSum returns the SHA-256 of the bytes of attachment name of id, as GET returns them.
func attachmentSum(t *testing.T, s *couchtest.Server, db, id, name string) [32]byte {
	t.Helper()
	st, body := raw(t, s, http.MethodGet, "/"+url.PathEscape(db)+"/"+url.PathEscape(id)+"/"+url.PathEscape(name), nil, "*/*")
	require.Equal(t, http.StatusOK, st, "GET attachment %s/%s", id, name)
	return sha256.Sum256(body)
}

// TestLargeAttachments: a doc with a 3 MiB attachment (and a small one) is streamed as
// multipart/related, docs with small attachments travel inline, docs without any as before;
// the target's attachment bytes equal the source's. An update of the big doc that keeps its
// attachment sends it as a stub: its bytes are not read again.
func TestLargeAttachments(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "lasrc_"), s.NewDB(t, "latgt_")
	big, note := randomBytes(t, 3<<20), []byte("a small note")
	s.Put(t, source, "big", map[string]any{"v": 1, "_attachments": map[string]any{
		"blob.bin": inlineAttachment(big), "note.txt": inlineAttachment(note),
	}})
	for i := range 3 {
		s.Put(t, source, fmt.Sprintf("small%d", i), map[string]any{"v": i, "_attachments": map[string]any{
			"a.bin": inlineAttachment(randomBytes(t, 1000*(i+1))),
		}})
		s.Put(t, source, fmt.Sprintf("plain%d", i), map[string]any{"v": i})
	}
	log := &requestLog{base: &http.Transport{DisableCompression: true}}
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), HTTPClient: &http.Client{Transport: log}}

	res, err := Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 7, res.DocsWritten)
	assert.Zero(t, res.DocWriteFailures)
	reqs := log.take()
	assert.Equal(t, 1, count(reqs, func(r string) bool {
		return strings.HasPrefix(r, "PUT ") && strings.Contains(r, "multipart/related")
	}), "one multipart PUT: %v", reqs)
	requireSameLeaves(t, s, source, target)
	for _, a := range [][2]string{{"big", "blob.bin"}, {"big", "note.txt"}, {"small0", "a.bin"}, {"small2", "a.bin"}} {
		assert.Equal(t, attachmentSum(t, s, source, a[0], a[1]), attachmentSum(t, s, target, a[0], a[1]), "%s/%s", a[0], a[1])
	}
	assert.Equal(t, sha256.Sum256(big), attachmentSum(t, s, target, "big", "blob.bin"))

	// Update the big doc without touching its attachments.
	var doc map[string]any
	require.NoError(t, s.Do(t, http.MethodGet, "/"+url.PathEscape(source)+"/big", nil, &doc))
	doc["v"] = 2
	st, body := raw(t, s, http.MethodPut, "/"+url.PathEscape(source)+"/big", doc, "application/json")
	require.Equal(t, http.StatusCreated, st, string(body))

	res, err = Run(t.Context(), opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.DocsWritten)
	assert.Zero(t, res.DocWriteFailures)
	reqs = log.take()
	assert.Zero(t, count(reqs, func(r string) bool { return strings.Contains(r, "/big/") }),
		"the unchanged attachments are not read again: %v", reqs)
	requireSameLeaves(t, s, source, target)
	assert.Equal(t, sha256.Sum256(big), attachmentSum(t, s, target, "big", "blob.bin"))
	var got map[string]any
	require.NoError(t, s.Do(t, http.MethodGet, "/"+url.PathEscape(target)+"/big", nil, &got))
	assert.EqualValues(t, 2, got["v"])
}

// TestAncestorPos checks the atts_since rule on a doc's revision path.
func TestAncestorPos(t *testing.T) {
	t.Parallel()
	var d attachedDoc
	require.NoError(t, json.Unmarshal([]byte(`{"start":3,"ids":["c","b","a"]}`), &d.revisions))
	d.atts = map[string]attachmentStub{
		"old": {Stub: true, RevPos: 1, Length: 10},
		"new": {Stub: true, RevPos: 3, Length: 20},
	}
	tests := []struct {
		revs  []string
		pos   int
		names []string
		size  int64
	}{
		{nil, 0, []string{"new", "old"}, 30},
		{[]string{"2-b"}, 2, []string{"new"}, 20},
		{[]string{"2-x", "1-a"}, 1, []string{"new"}, 20},
		{[]string{"2-x", "bad", "9-c"}, 0, []string{"new", "old"}, 30},
		{[]string{"3-c"}, 3, nil, 0},
	}
	for _, tc := range tests {
		pos := d.ancestorPos(tc.revs)
		assert.Equal(t, tc.pos, pos, "%v", tc.revs)
		names, size := d.needed(pos)
		assert.Equal(t, tc.names, names, "%v", tc.revs)
		assert.Equal(t, tc.size, size, "%v", tc.revs)
	}
	assert.True(t, streamable([]string{"a.bin", "dir/x y.txt"}))
	assert.False(t, streamable([]string{`q"uote`}))
	assert.False(t, streamable([]string{"ünï"}))
}

// TestLargeAttachmentUnderOneConnection: with the watched server's client capped to one
// connection for requests (couch.Config.MaxConns), a multipart PUT, which holds that connection
// while its body streams, still gets its attachment from the source over the client's stream
// transport. Reading the attachment over the capped transport would wait for the PUT's
// connection forever.
func TestLargeAttachmentUnderOneConnection(t *testing.T) {
	s := couchtest.Get(t)
	source, target := s.NewDB(t, "la1src_"), s.NewDB(t, "la1tgt_")
	big := randomBytes(t, 1<<20)
	s.Put(t, source, "big", map[string]any{"_attachments": map[string]any{"blob.bin": inlineAttachment(big)}})
	c, err := couch.New(couch.Config{URL: s.URL, MaxConns: 1}, nil)
	require.NoError(t, err)
	opt := Options{Source: dbURL(s, source), Target: dbURL(s, target), HTTPClient: c.HTTPClient(), StreamHTTPClient: c.StreamHTTPClient()}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	res, err := Run(ctx, opt, testLog(t))
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.DocsWritten)
	assert.Equal(t, sha256.Sum256(big), attachmentSum(t, s, target, "big", "blob.bin"))
}
