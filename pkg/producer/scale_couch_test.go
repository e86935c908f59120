package producer

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// scaleCouch is the CouchDB of BenchmarkScale: n dbs (db0000000 …), and just what the producer
// and a consumer's job path ask of a server that holds them: a continuous _db_updates feed (one
// "updated" event per db, then, once deleteAll is called, one "deleted" event per db), _all_dbs,
// POST /_dbs_info and GET /{db}. Everything it serves is built before the benchmark's first
// memory reading, so its own heap is part of the baseline, not of the figures per db.
type scaleCouch struct {
	srv      *httptest.Server
	names    []string // sorted
	infos    [][]byte // GET /{db} answers
	lines    [][]byte // feed lines: n updated events, then n deleted events
	updSeq   []string
	deleted  atomic.Bool
	visible  atomic.Int64 // feed lines served so far
	mu       sync.Mutex
	grown    chan struct{} // closed and replaced when visible grows
	requests [scaleEndpoints]atomic.Int64
	conns    atomic.Int64 // open connections: each holds one goroutine of the server's in this process
}

// Endpoints of scaleCouch whose requests are counted.
const (
	epDBUpdates = iota
	epAllDBs
	epDBsInfo
	epDBInfo
	scaleEndpoints
)

var scaleEndpointNames = [scaleEndpoints]string{"_db_updates", "_all_dbs", "_dbs_info", "GET /{db}"}

func scaleDBName(i int) string { return fmt.Sprintf("db%07d", i) }

// feedSeq is the opaque-looking seq of feed line i (0-based): its number, a dash, noise.
func feedSeq(i int) string {
	return strconv.Itoa(i+1) + "-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3"
}

func newScaleCouch(t testing.TB, n int) *scaleCouch {
	c := &scaleCouch{grown: make(chan struct{})}
	c.names = make([]string, n)
	c.infos = make([][]byte, n)
	c.updSeq = make([]string, n)
	c.lines = make([][]byte, 0, 2*n)
	for i := range n {
		db := scaleDBName(i)
		c.names[i] = db
		c.updSeq[i] = fmt.Sprintf("1-g1AAAABXeJzLYWBgYMpgSmHgKy%d", i)
		c.infos[i] = fmt.Appendf(nil, `{"db_name":%q,"update_seq":%q,"doc_count":1,"instance_start_time":"0"}`, db, c.updSeq[i])
		c.lines = append(c.lines, fmt.Appendf(nil, `{"db_name":%q,"type":"updated","seq":%q}`+"\n", db, feedSeq(i)))
	}
	for i := range n {
		c.lines = append(c.lines, fmt.Appendf(nil, `{"db_name":%q,"type":"deleted","seq":%q}`+"\n", scaleDBName(i), feedSeq(n+i)))
	}
	c.visible.Store(int64(n))
	c.srv = httptest.NewUnstartedServer(http.HandlerFunc(c.serve))
	c.srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			c.conns.Add(1)
		case http.StateClosed, http.StateHijacked:
			c.conns.Add(-1)
		}
	}
	c.srv.Start()
	t.Cleanup(c.srv.Close)
	return c
}

// deleteAll deletes every db: they are gone from every endpoint, and the feed announces it.
func (c *scaleCouch) deleteAll() {
	c.deleted.Store(true)
	c.mu.Lock()
	c.visible.Store(int64(len(c.lines)))
	close(c.grown)
	c.grown = make(chan struct{})
	c.mu.Unlock()
}

// counts returns the requests served so far by endpoint.
func (c *scaleCouch) counts() map[string]int64 {
	out := map[string]int64{}
	for i := range c.requests {
		out[scaleEndpointNames[i]] = c.requests[i].Load()
	}
	return out
}

func (c *scaleCouch) serve(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	switch {
	case r.URL.Path == "/_db_updates":
		c.requests[epDBUpdates].Add(1)
		c.feed(w, r)
	case r.URL.Path == "/_all_dbs":
		c.requests[epAllDBs].Add(1)
		c.allDBs(w, r)
	case r.URL.Path == "/_dbs_info" && r.Method == http.MethodPost:
		c.requests[epDBsInfo].Add(1)
		c.dbsInfo(w, r)
	case r.Method == http.MethodGet && !strings.Contains(strings.TrimPrefix(r.URL.Path, "/"), "/"):
		c.requests[epDBInfo].Add(1)
		i, ok := c.index(strings.TrimPrefix(r.URL.Path, "/"))
		if !ok {
			notFound(w)
			return
		}
		_, _ = w.Write(c.infos[i])
	default:
		http.Error(w, `{"error":"not_found","reason":"not served by the scale benchmark"}`, http.StatusNotFound)
	}
}

func notFound(w http.ResponseWriter) {
	w.WriteHeader(http.StatusNotFound)
	_, _ = w.Write([]byte(`{"error":"not_found","reason":"Database does not exist."}`))
}

// index returns the position of an existing db.
func (c *scaleCouch) index(db string) (int, bool) {
	if c.deleted.Load() || !strings.HasPrefix(db, "db") {
		return 0, false
	}
	i, err := strconv.Atoi(db[2:])
	if err != nil || i < 0 || i >= len(c.names) || c.names[i] != db {
		return 0, false
	}
	return i, true
}

// feed serves the continuous feed from since (the number before the seq's dash), then a
// heartbeat newline every heartbeat until new lines come or the client leaves.
func (c *scaleCouch) feed(w http.ResponseWriter, r *http.Request) {
	from := 0
	if s := r.URL.Query().Get("since"); s != "" && s != "0" && s != "now" {
		n, err := strconv.Atoi(strings.SplitN(s, "-", 2)[0])
		if err != nil {
			http.Error(w, `{"error":"bad_request","reason":"since"}`, http.StatusBadRequest)
			return
		}
		from = n
	}
	if r.URL.Query().Get("since") == "now" {
		from = int(c.visible.Load())
	}
	hb := time.Second
	if ms, err := strconv.Atoi(r.URL.Query().Get("heartbeat")); err == nil && ms > 0 {
		hb = min(hb, time.Duration(ms)*time.Millisecond)
	}
	fl := w.(http.Flusher)
	tick := time.NewTicker(hb)
	defer tick.Stop()
	for {
		c.mu.Lock()
		grown := c.grown
		c.mu.Unlock()
		to := int(c.visible.Load())
		for ; from < to; from++ {
			if _, err := w.Write(c.lines[from]); err != nil {
				return
			}
		}
		fl.Flush()
		if r.URL.Query().Get("feed") != "continuous" {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-grown:
		case <-tick.C:
			if _, err := w.Write([]byte("\n")); err != nil {
				return
			}
		}
	}
}

// allDBs serves one page of names: from startkey (inclusive), at most limit.
func (c *scaleCouch) allDBs(w http.ResponseWriter, r *http.Request) {
	if c.deleted.Load() {
		_, _ = w.Write([]byte("[]"))
		return
	}
	from := 0
	if sk := r.URL.Query().Get("startkey"); sk != "" {
		var key string
		if err := json.Unmarshal([]byte(sk), &key); err != nil {
			http.Error(w, `{"error":"bad_request","reason":"startkey"}`, http.StatusBadRequest)
			return
		}
		from = sort.SearchStrings(c.names, key)
	}
	to := len(c.names)
	if l, err := strconv.Atoi(r.URL.Query().Get("limit")); err == nil && l >= 0 {
		to = min(to, from+l)
	}
	_ = json.NewEncoder(w).Encode(c.names[from:to])
}

// dbsInfo serves POST /_dbs_info as CouchDB 3 does: one row per key, not_found for a missing db.
func (c *scaleCouch) dbsInfo(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Keys []string `json:"keys"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, `{"error":"bad_request","reason":"body"}`, http.StatusBadRequest)
		return
	}
	out := make([]byte, 0, 128*len(body.Keys))
	out = append(out, '[')
	for k, db := range body.Keys {
		if k > 0 {
			out = append(out, ',')
		}
		key, _ := json.Marshal(db)
		if i, ok := c.index(db); ok {
			out = fmt.Appendf(out, `{"key":%s,"info":%s}`, key, c.infos[i])
		} else {
			out = fmt.Appendf(out, `{"key":%s,"error":"not_found"}`, key)
		}
	}
	out = append(out, ']')
	_, _ = w.Write(out)
}

// parseSeqNumber returns the number before a feed seq's dash (0 for none).
func parseSeqNumber(seq string) int {
	n, _ := strconv.Atoi(strings.SplitN(seq, "-", 2)[0])
	return n
}
