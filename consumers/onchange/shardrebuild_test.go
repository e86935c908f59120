package main

import (
	"bytes"
	"compress/zlib"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// The shard-rebuild test needs a CouchDB cluster of three nodes or more that it may stop and
// start, on this machine (it deletes a shard file under a node's data dir):
//
//	SPIEGEL_TEST_COUCHDB_CLUSTER   the nodes' URLs with credentials, comma-separated; the first
//	                               is the env's server (COUCHDB_URL must name the same node), the
//	                               last is the node whose shard copy is rebuilt
//	SPIEGEL_TEST_COUCHDB_NODE_CMD  a command template run by sh -c: {action} becomes stop or
//	                               start, {node} the node's position in the list (1-based);
//	                               both must wait until done (start: until GET /_up answers)
//
// e.g. SPIEGEL_TEST_COUCHDB_NODE_CMD='/path/to/cluster/node.sh {action} {node}'.
const (
	clusterEnv = "SPIEGEL_TEST_COUCHDB_CLUSTER"
	nodeCmdEnv = "SPIEGEL_TEST_COUCHDB_NODE_CMD"
)

// TestShardRebuildResendsNothing: CouchDB's internal replication rebuilding one node's copy of a
// db's shard (the copy's file deleted while the node was down; mem3_sync copies the range back
// from the other copies into a new file, with a new uuid) is not a db created again: a rule
// whose checkpoint names another copy acts on the next change only, and no webhook gets the db's
// history again. When the checkpoint names the rebuilt copy, CouchDB's own feed sends the range's
// history again (below): the consumer adds nothing to it (no start over, no other doc), and the
// webhook gets each doc of it at most once more, at the revision it already had.
//
// The consumer talks to the cluster through a proxy (to the last node, switched to another
// while the rebuilt node is down). Which copy the rule's checkpoint names is up to the cluster
// (its coordinator reads each range from the copy that answers first), so each subtest picks
// the node to rebuild from the checkpoint: another copy than the one it names, or that one.
// Before 817a34d a first page naming a new file of the checkpoint's copy started the rule over
// (couch.FilesReplaced); now nothing reads seqs.
//
// Measured on a three-node CouchDB 3.3.3 cluster (q=1, n=3), before and after 817a34d alike:
// "another copy" gets 6 calls; "the rebuilt copy" 11, d1..d5 twice. The
// feed itself sends the history again: CouchDB reads a since whose copy's file uuid it no longer
// has from 0 (couch_db:calculate_start_seq, "uuid prefix mismatch ... rewind"), whatever the
// consumer does with seqs (the re-sent calls carry seqs 1..5 of the new file); before 817a34d
// the rule also logged that it started over. The test waits until the rebuilt copy itself holds
// the history before d6 is written: otherwise d6 can be the new file's first change and the
// history comes after it, in a later job.
func TestShardRebuildResendsNothing(t *testing.T) {
	nodes, runNode := clusterFromEnv(t)
	t.Run("checkpoint names another copy", func(t *testing.T) { shardRebuild(t, nodes, runNode, false) })
	t.Run("checkpoint names the rebuilt copy", func(t *testing.T) { shardRebuild(t, nodes, runNode, true) })
}

// shardRebuild delivers a db's history, rebuilds one node's copy of its only shard range (the
// copy the rule's checkpoint names when named, another otherwise), writes one doc and checks
// that the webhook got that doc alone.
func shardRebuild(t *testing.T, nodes []string, runNode func(string, int), named bool) {
	e := newEnv(t, 60*time.Second)
	require.True(t, e.Couch.Cluster, "COUCHDB_URL must name a node of the cluster in %s", clusterEnv)
	require.Equal(t, hostOf(t, nodes[0]), hostOf(t, e.Couch.URL), "COUCHDB_URL must name the first node of %s", clusterEnv)
	clients := make([]*nodeClient, len(nodes))
	names := make([]string, len(nodes))
	for i, u := range nodes {
		clients[i] = newNodeClient(t, u)
		names[i] = clients[i].name(t)
	}

	// The consumer's CouchDB requests go through a proxy.
	var target atomic.Pointer[url.URL]
	target.Store(clients[len(nodes)-1].base)
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target.Load())
			r.Out.Host = r.Out.URL.Host
		},
		FlushInterval: -1, // continuous feeds line by line
		Transport:     &http.Transport{DisableCompression: true},
		ErrorLog:      log.New(io.Discard, "", 0), // feeds cut when a node stops
	}
	proxy := httptest.NewServer(rp)
	t.Cleanup(proxy.Close)
	pu, err := url.Parse(proxy.URL)
	require.NoError(t, err)
	pu.User = clients[len(nodes)-1].user
	e.cfg.CouchDB.CouchDBURL = pu.String()
	app := e.start(t)

	db := e.Couch.NewOneShardDB(t, e.Prefix)
	var shards struct {
		Shards map[string][]string `json:"shards"`
	}
	require.NoError(t, e.Couch.Do(t, http.MethodGet, "/"+couchtest.PathDB(db)+"/_shards", nil, &shards))
	require.Len(t, shards.Shards, 1, "q=1: one shard range")
	var shardRange string
	var holders []string
	for r, copies := range shards.Shards {
		shardRange, holders = r, copies
	}
	require.GreaterOrEqual(t, len(holders), 3, "copies of the range (n=3): %v", holders)

	s := newSink(t, nil)
	e.ruleIn(t, app, "r", db, map[string]any{"url": s.URL + "/r", "block": true,
		"params": map[string]any{"id": "$change.id", "seq": "$seq"}})
	history := []string{"d1", "d2", "d3", "d4", "d5"}
	for _, id := range history {
		e.Couch.Put(t, db, id, map[string]any{})
	}
	e.enqueue(t, db)
	s.waitHits(t, 30*time.Second, func(hs []hit) bool { return len(hs) >= len(history) }, "the history delivered")
	require.Eventually(t, func() bool { return e.caughtUp(t, "r", db) }, 20*time.Second, 50*time.Millisecond, "the rule caught up")
	require.ElementsMatch(t, history, ids(s.all()), "each doc once")
	before, found := e.checkpoint(t, "r", db)
	require.True(t, found)
	cpCopies := seqCopies(before)
	require.Len(t, cpCopies, 1, "the checkpoint %q names one copy", before)

	// The node to rebuild: the checkpoint's copy's, or the last other one.
	v := -1
	for i := len(nodes) - 1; i >= 0; i-- {
		if slices.Contains(holders, names[i]) && (names[i] == cpCopies[0]) == named {
			v = i
			break
		}
	}
	require.GreaterOrEqual(t, v, 0, "a node to rebuild")
	victim, victimN := clients[v], v+1 // victimN: 1-based, as {node} in the command
	dataDir := victim.config(t, "couchdb", "database_dir")
	require.True(t, filepath.IsAbs(dataDir), "node %d's database_dir %q: an absolute path is needed to find its shard files", victimN, dataDir)
	t.Logf("the checkpoint names the copy %v; rebuilding the copy on %s (node %d)", seqFiles(before), names[v], victimN)

	// Rebuild the victim's copy: stop it, delete its shard file, start it; internal replication
	// fills the new file from the other copies.
	target.Store(clients[(v+1)%len(nodes)].base)
	t.Cleanup(func() { runNode("start", victimN) }) // up again whatever happens
	runNode("stop", victimN)
	files, err := filepath.Glob(filepath.Join(dataDir, "shards", shardRange, db+".*.couch"))
	require.NoError(t, err)
	suffix := regexp.MustCompile(`^\.[0-9]+\.couch$`)
	var removed []string
	for _, f := range files {
		if suffix.MatchString(strings.TrimPrefix(filepath.Base(f), db)) {
			require.NoError(t, os.Remove(f))
			removed = append(removed, f)
		}
	}
	require.Len(t, removed, 1, "node %d's shard file of %s under %s", victimN, db, dataDir)
	runNode("start", victimN)

	// The rebuilt copy holds the history: a page read through the victim whose seq names the
	// victim's copy (the coordinator takes the first copy to answer per range, the victim's
	// own most often) lists every doc. Its seq names the new file.
	var fresh string
	require.Eventually(t, func() bool {
		page, err := victim.changes(db)
		if err != nil || !slices.Contains(seqCopies(page.LastSeq), names[v]) {
			return false
		}
		fresh = page.LastSeq
		return len(page.Results) == len(history)
	}, 120*time.Second, 300*time.Millisecond, "node %d's own copy serves the db with all docs again", victimN)
	_, err = os.Stat(removed[0])
	require.NoError(t, err, "the shard file is there again")
	t.Logf("the rebuilt copy: %v (the checkpoint: %v)", seqFiles(fresh), seqFiles(before))
	if named {
		require.NotEqual(t, seqFiles(before), seqFiles(fresh), "the rebuilt copy is a new file")
	}
	target.Store(victim.base)

	// One more change: it alone is delivered.
	e.Couch.Put(t, db, "d6", map[string]any{})
	e.enqueue(t, db)
	s.waitHits(t, 30*time.Second, hasID("d6"), "the new doc delivered")
	// Let anything else the job would send arrive (with block: true a re-sent history comes
	// before d6, in feed order).
	require.Eventually(t, func() bool {
		cp, _ := e.checkpoint(t, "r", db)
		return cp != before && e.WorkMsgs(t) == 0
	}, 20*time.Second, 50*time.Millisecond, "the job ended")
	time.Sleep(time.Second)
	after, _ := e.checkpoint(t, "r", db)
	got := ids(s.all())
	t.Logf("checkpoint after the rebuild names %v; sink calls: %d %v, their seqs %v",
		seqFiles(after), len(got), got, seqCopyNames(s.all()))
	// When the checkpoint names the rebuilt copy, CouchDB itself reads that copy's range from 0
	// (see above): the history may come once more, every doc of it, at the revisions already
	// delivered, and nothing else does.
	again := 1
	if n := count(got)["d1"]; named && n == 2 {
		again = 2
	}
	want := map[string]int{"d6": 1}
	for _, id := range history {
		want[id] = again
	}
	assert.Equal(t, want, count(got), "calls per doc: the history once (twice when CouchDB rewound the checkpoint's copy), d6 once")
	assert.NotContains(t, e.Logs.String(), "starting over")
}

// clusterFromEnv returns the cluster's node URLs and a function running the node command, or
// skips the test.
func clusterFromEnv(t *testing.T) (nodes []string, runNode func(action string, n int)) {
	t.Helper()
	raw, tmpl := os.Getenv(clusterEnv), os.Getenv(nodeCmdEnv)
	if raw == "" || tmpl == "" {
		t.Skipf("needs a CouchDB cluster it may stop and start: set %s (node URLs, comma-separated) and %s (e.g. '/path/node.sh {action} {node}')", clusterEnv, nodeCmdEnv)
	}
	for _, u := range strings.Split(raw, ",") {
		if u = strings.TrimRight(strings.TrimSpace(u), "/"); u != "" {
			nodes = append(nodes, u)
		}
	}
	if len(nodes) < 3 {
		t.Fatalf("%s names %d nodes; 3 or more are needed (n=3, one copy rebuilt)", clusterEnv, len(nodes))
	}
	if !strings.Contains(tmpl, "{action}") || !strings.Contains(tmpl, "{node}") {
		t.Fatalf("%s must hold {action} and {node}: %q", nodeCmdEnv, tmpl)
	}
	runNode = func(action string, n int) {
		t.Helper()
		cmd := strings.NewReplacer("{action}", action, "{node}", fmt.Sprint(n)).Replace(tmpl)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, "sh", "-c", cmd).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmd, err, out)
		}
		t.Logf("%s: %s", cmd, bytes.TrimSpace(out))
	}
	return nodes, runNode
}

// hostOf returns raw's host:port.
func hostOf(t *testing.T, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	return u.Host
}

// nodeClient talks to one node of the cluster.
type nodeClient struct {
	base *url.URL // without credentials
	user *url.Userinfo
	hc   *http.Client
}

func newNodeClient(t *testing.T, raw string) *nodeClient {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	c := &nodeClient{user: u.User, hc: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableCompression: true}}}
	u.User = nil
	c.base = u
	return c
}

// get decodes the JSON answer to GET path into out.
func (c *nodeClient) get(path string, out any) error {
	req, err := http.NewRequest(http.MethodGet, c.base.String()+path, nil)
	if err != nil {
		return err
	}
	if c.user != nil {
		p, _ := c.user.Password()
		req.SetBasicAuth(c.user.Username(), p)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", path, resp.Status, bytes.TrimSpace(b))
	}
	return json.Unmarshal(b, out)
}

// name returns the node's Erlang node name.
func (c *nodeClient) name(t *testing.T) string {
	t.Helper()
	var n struct {
		Name string `json:"name"`
	}
	require.NoError(t, c.get("/_node/_local", &n))
	require.NotEmpty(t, n.Name)
	return n.Name
}

// config returns a config value of the node.
func (c *nodeClient) config(t *testing.T, section, key string) string {
	t.Helper()
	var v string
	require.NoError(t, c.get("/_node/_local/_config/"+section+"/"+key, &v))
	return v
}

// changesPage is a page of a _changes feed.
type changesPage struct {
	Results []struct {
		ID string `json:"id"`
	} `json:"results"`
	LastSeq string `json:"last_seq"`
}

// changes reads db's feed from the beginning through the node.
func (c *nodeClient) changes(db string) (changesPage, error) {
	var page changesPage
	err := c.get("/"+couchtest.PathDB(db)+"/_changes", &page)
	return page, err
}

// seqCopies returns the node of each shard copy a CouchDB 2+ seq names, in its order (nil when
// it cannot be decoded). The test only reports and looks for copies: spiegel never reads seqs.
func seqCopies(seq string) []string {
	var out []string
	for _, f := range seqFiles(seq) {
		node, _, _ := strings.Cut(f, ":")
		out = append(out, node)
	}
	return out
}

// seqFiles returns "node:uuid" of each shard copy a CouchDB 2+ seq names: the node and the
// prefix of the file's uuid (a rebuilt copy has a new one).
func seqFiles(seq string) []string {
	_, packed, ok := strings.Cut(seq, "-")
	if !ok {
		return nil
	}
	b, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(packed, "="))
	if err != nil || len(b) < 2 || b[0] != 131 {
		return nil
	}
	b = b[1:]
	if b[0] == 80 { // compressed: 4 bytes of size, then zlib
		if len(b) < 5 {
			return nil
		}
		zr, err := zlib.NewReader(bytes.NewReader(b[5:]))
		if err != nil {
			return nil
		}
		if b, err = io.ReadAll(zr); err != nil {
			return nil
		}
	}
	d := &termReader{b: b}
	v, err := d.term()
	if err != nil {
		return nil
	}
	list, _ := v.([]any)
	var out []string
	for _, entry := range list { // {Node, [Begin, End], {Seq, Uuid, EpochNode}}
		tup, _ := entry.([]any)
		if len(tup) != 3 {
			continue
		}
		node, _ := tup[0].(string)
		var uuid termBinary
		if pos, ok := tup[2].([]any); ok && len(pos) >= 2 {
			uuid, _ = pos[1].(termBinary)
		}
		out = append(out, node+":"+string(uuid))
	}
	return out
}

// termBinary is an Erlang binary.
type termBinary string

// termReader decodes the part of Erlang's external term format a packed seq uses: lists and
// tuples (both as []any), atoms (string), binaries (termBinary), integers (nil).
type termReader struct{ b []byte }

func (d *termReader) take(n int) ([]byte, error) {
	if n < 0 || len(d.b) < n {
		return nil, errors.New("short term")
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p, nil
}

func (d *termReader) term() (any, error) {
	tag, err := d.take(1)
	if err != nil {
		return nil, err
	}
	n := 0
	switch tag[0] {
	case 97: // SMALL_INTEGER_EXT
		_, err = d.take(1)
		return nil, err
	case 98: // INTEGER_EXT
		_, err = d.take(4)
		return nil, err
	case 110: // SMALL_BIG_EXT
		l, err := d.take(1)
		if err != nil {
			return nil, err
		}
		_, err = d.take(1 + int(l[0]))
		return nil, err
	case 106: // NIL_EXT
		return []any(nil), nil
	case 107: // STRING_EXT
		l, err := d.take(2)
		if err != nil {
			return nil, err
		}
		_, err = d.take(int(binary.BigEndian.Uint16(l)))
		return nil, err
	case 109: // BINARY_EXT
		l, err := d.take(4)
		if err != nil {
			return nil, err
		}
		b, err := d.take(int(binary.BigEndian.Uint32(l)))
		return termBinary(b), err
	case 100, 118: // ATOM_EXT, ATOM_UTF8_EXT
		l, err := d.take(2)
		if err != nil {
			return nil, err
		}
		a, err := d.take(int(binary.BigEndian.Uint16(l)))
		return string(a), err
	case 115, 119: // SMALL_ATOM_EXT, SMALL_ATOM_UTF8_EXT
		l, err := d.take(1)
		if err != nil {
			return nil, err
		}
		a, err := d.take(int(l[0]))
		return string(a), err
	case 104: // SMALL_TUPLE_EXT
		l, err := d.take(1)
		if err != nil {
			return nil, err
		}
		n = int(l[0])
	case 108: // LIST_EXT: elements, then a tail
		l, err := d.take(4)
		if err != nil {
			return nil, err
		}
		out, err := d.terms(int(binary.BigEndian.Uint32(l)))
		if err != nil {
			return nil, err
		}
		_, err = d.term() // the tail, [] for a proper list
		return out, err
	default:
		return nil, fmt.Errorf("term tag %d", tag[0])
	}
	return d.terms(n)
}

func (d *termReader) terms(n int) ([]any, error) {
	out := make([]any, 0, n)
	for range n {
		v, err := d.term()
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// seqCopyNames returns each hit's seq as its number and the copies it names.
func seqCopyNames(hs []hit) []string {
	out := make([]string, 0, len(hs))
	for _, h := range hs {
		n, _, _ := strings.Cut(h.param("seq"), "-")
		out = append(out, n+"@"+strings.Join(seqFiles(h.param("seq")), ","))
	}
	return out
}
