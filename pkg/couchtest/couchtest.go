// Package couchtest gives tests the real CouchDB-compatible server named by COUCHDB_URL (the test
// command starts PouchDB Server and sets it) and unique databases that are removed afterwards,
// a TCP Proxy that can cut the server off, and an UpdatesProxy that also gives PouchDB Server a
// CouchDB-3-like _db_updates feed with real positions.
package couchtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-kivik/kivik/v4"
	"github.com/go-kivik/kivik/v4/couchdb"

	"github.com/spiegel-nats/spiegel/pkg/couchpath"
)

// Server is the CouchDB server under test.
type Server struct {
	// URL is the server's base URL with credentials, without a trailing slash.
	URL string
	// Client is a kivik client for the server (compression disabled).
	Client *kivik.Client
	// HTTP is a plain client for requests kivik does not cover.
	HTTP *http.Client
	// PouchDB is true when the server is PouchDB Server rather than Apache CouchDB.
	PouchDB bool
	// Version is the server's version string.
	Version string
	// Cluster is true when the server is one node of a CouchDB cluster of several nodes: a read
	// may be answered by other shard copies than the write before it (seqs naming other copies,
	// _local docs and _db_updates rows that lag on one copy).
	Cluster bool
	// writeAll is the w that the clients above send with every write on a cluster (its nodes,
	// at most CouchDB's default n=3; 0: the server's default). See allCopies.
	writeAll *atomic.Int32
}

var counter atomic.Int64

// idleConnTimeout closes the test clients' idle connections before PouchDB Server does (Node's
// HTTP server drops a keep-alive connection after 5 s idle): a request sent on a connection the
// server is closing fails with EOF, and a write (PUT, POST) is not resent by net/http. It made a
// test's doc write fail through the updates proxy under load.
const idleConnTimeout = 3 * time.Second

// Get returns the server from COUCHDB_URL. Without it the test is skipped, unless
// SPIEGEL_REQUIRE_COUCHDB is set (as the test command does), in which case it fails; the
// package's TestMain (Main) counts the skips and reports them in one line.
func Get(t testing.TB) *Server {
	t.Helper()
	raw := strings.TrimRight(os.Getenv("COUCHDB_URL"), "/")
	if raw == "" {
		if os.Getenv("SPIEGEL_REQUIRE_COUCHDB") != "" {
			t.Fatal("couchtest: COUCHDB_URL is unset; the test command must start a server")
		}
		skip()
		t.Skip("couchtest: COUCHDB_URL is unset; run `make test`, which starts PouchDB Server")
	}
	s := newServer(t, raw)
	var root struct {
		Version string `json:"version"`
		Vendor  struct {
			Name string `json:"name"`
		} `json:"vendor"`
		PouchDB string `json:"express-pouchdb"`
	}
	if err := s.Do(t, http.MethodGet, "/", nil, &root); err != nil {
		t.Fatalf("couchtest: server at COUCHDB_URL does not answer: %v", err)
	}
	s.Version = root.Version
	s.PouchDB = root.PouchDB != "" || strings.Contains(root.Vendor.Name, "PouchDB")
	if !s.PouchDB {
		var members struct {
			ClusterNodes []string `json:"cluster_nodes"`
		}
		if err := s.Do(t, http.MethodGet, "/_membership", nil, &members); err == nil {
			s.Cluster = len(members.ClusterNodes) > 1
			if s.Cluster {
				s.writeAll.Store(int32(min(len(members.ClusterNodes), 3)))
			}
		}
	}
	return s
}

// newServer returns a Server for url, its clients set up, nothing else filled in.
func newServer(t testing.TB, url string) *Server {
	t.Helper()
	// PlusSafe: kivik escapes db names with url.PathEscape, which leaves '+' as is, and CouchDB 3
	// reads a '+' in a path as a space.
	w := new(atomic.Int32)
	hc := &http.Client{Transport: allCopies{w: w, next: couchpath.PlusSafe(&http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64, IdleConnTimeout: idleConnTimeout})}}
	c, err := kivik.New("couch", url, couchdb.OptionHTTPClient(hc))
	if err != nil {
		t.Fatalf("couchtest: client for %s: %v", url, err)
	}
	return &Server{URL: url, Client: c, HTTP: hc, writeAll: w}
}

// allCopies adds w (when set) to the test's writes to dbs on a cluster: CouchDB answers a
// write once w copies have it (2 of 3 by default), and a read right after it may be answered
// by the third, which has not (a doc count of 0, a _changes feed without the write, an update
// rejected for a missing attachment stub). A test that writes and then reads means to read its
// write: with w = every copy, it does, whichever copy answers. The processes under test keep
// the server's defaults.
type allCopies struct {
	w    *atomic.Int32
	next http.RoundTripper
}

func (a allCopies) RoundTrip(req *http.Request) (*http.Response, error) {
	w := a.w.Load()
	switch {
	case w == 0, req.Method != http.MethodPut && req.Method != http.MethodPost && req.Method != http.MethodDelete,
		strings.HasPrefix(req.URL.Path, "/_"), req.URL.Query().Has("w"):
		return a.next.RoundTrip(req)
	}
	req = req.Clone(req.Context())
	q := req.URL.Query()
	q.Set("w", fmt.Sprint(w))
	req.URL.RawQuery = q.Encode()
	return a.next.RoundTrip(req)
}

// UniqueName returns a db name unique to this test run: prefix, the test's short name and a
// counter, lower-cased to satisfy CouchDB's naming rule.
func UniqueName(t testing.TB, prefix string) string {
	n := counter.Add(1)
	name := strings.ToLower(t.Name())
	name = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		return '_'
	}, name)
	if len(name) > 40 {
		name = name[len(name)-40:]
	}
	return fmt.Sprintf("%s%s_%d_%d", prefix, name, time.Now().UnixNano()%1e9, n)
}

// NewDB creates a uniquely named db and deletes it when the test ends.
func (s *Server) NewDB(t testing.TB, prefix string) string {
	t.Helper()
	name := UniqueName(t, prefix)
	s.CreateDB(t, name)
	return name
}

// NewOneShardDB creates a uniquely named db of one shard range (q=1) and deletes it when the
// test ends. Its _changes feed lists changes in the order they were written, on a CouchDB
// cluster too (a feed of several ranges merges them in no set order). PouchDB Server ignores q.
func (s *Server) NewOneShardDB(t testing.TB, prefix string) string {
	t.Helper()
	name := UniqueName(t, prefix)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Client.CreateDB(ctx, name, kivik.Param("q", 1)); err != nil {
		t.Fatalf("couchtest: create db %s: %v", name, err)
	}
	s.Cleanup(t, name)
	return name
}

// CreateDB creates the db name (which may contain any character CouchDB allows) and deletes it
// when the test ends.
func (s *Server) CreateDB(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Client.CreateDB(ctx, name); err != nil {
		t.Fatalf("couchtest: create db %s: %v", name, err)
	}
	s.Cleanup(t, name)
}

// Cleanup deletes the db name, if it exists, when the test ends.
func (s *Server) Cleanup(t testing.TB, name string) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = s.Client.DestroyDB(ctx, name)
	})
}

// CleanupPrefix deletes, when the test ends, every db whose name starts with prefix: the dbs a
// test's pipeline created (replication targets, a db recreated by a late write) besides those
// the test created itself. Register it before starting the processes, so that it runs after
// they stopped. prefix must be unique to the test (UniqueName's result and a separator).
func (s *Server) CleanupPrefix(t testing.TB, prefix string) {
	t.Cleanup(func() {
		for _, db := range s.prefixed(t, prefix) {
			if err := s.Do(t, http.MethodDelete, "/"+PathDB(db), nil, nil); err != nil && !strings.Contains(err.Error(), "404") {
				t.Errorf("couchtest: delete db %s left by the test: %v", db, err)
			}
		}
	})
}

// prefixed lists the dbs whose names start with prefix.
func (s *Server) prefixed(t testing.TB, prefix string) []string {
	var all []string
	if err := s.Do(t, http.MethodGet, "/_all_dbs", nil, &all); err != nil {
		t.Errorf("couchtest: list dbs to delete those starting with %s: %v", prefix, err)
		return nil
	}
	var out []string
	for _, db := range all {
		if strings.HasPrefix(db, prefix) {
			out = append(out, db)
		}
	}
	return out
}

// Put writes doc (any JSON-encodable value) as id and returns the new rev.
func (s *Server) Put(t testing.TB, db, id string, doc any) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rev, err := s.Client.DB(db).Put(ctx, id, doc)
	if err != nil {
		t.Fatalf("couchtest: put %s/%s: %v", db, id, err)
	}
	return rev
}

// Do sends a request to path (already escaped) with body encoded as JSON and decodes the answer
// into out when out is not nil. A status of 300 or more is an error.
func (s *Server) Do(t testing.TB, method, path string, body, out any) error {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, s.URL+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	resp, err := s.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode >= 300 {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(data))
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

// PathDB escapes a db name (or a doc id) as one path segment, '+' included (see
// couchpath.Segment).
func PathDB(name string) string { return couchpath.Segment(name) }
