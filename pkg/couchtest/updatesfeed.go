package couchtest

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

const (
	// defaultFeedTimeout ends longpoll feeds, and continuous feeds without heartbeat, as in
	// CouchDB.
	defaultFeedTimeout = 60 * time.Second
	// maxDBsInfoKeys is CouchDB 3's default max_db_number_for_dbs_info_req.
	maxDBsInfoKeys = 100
	// dbsInfoConcurrency bounds the GET /{db} requests of one POST /_dbs_info.
	dbsInfoConcurrency = 8
)

// feedParams are the query parameters of GET /_db_updates.
type feedParams struct {
	feed      string
	since     uint64
	limit     int           // < 0: none
	timeout   time.Duration // 0: none given
	heartbeat time.Duration // 0: none
}

// parseFeedParams reads the query as CouchDB 3.3 does, answering 400 itself when it is invalid.
func (p *UpdatesProxy) parseFeedParams(w http.ResponseWriter, r *http.Request) (feedParams, bool) {
	q := r.URL.Query()
	fp := feedParams{feed: q.Get("feed"), limit: -1}
	switch fp.feed {
	case "":
		fp.feed = "normal"
	case "normal", "longpoll", "continuous":
	case "eventsource":
		writeJSONError(w, http.StatusBadRequest, "bad_request", "couchtest: feed=eventsource is not emulated")
		return fp, false
	default:
		writeJSONError(w, http.StatusBadRequest, "bad_request",
			"Supported `feed` types: normal, continuous, longpoll, eventsource")
		return fp, false
	}
	millis := func(name string) (time.Duration, bool) {
		v := q.Get(name)
		if v == "" {
			return 0, true
		}
		switch {
		case name == "heartbeat" && v == "true":
			return defaultFeedTimeout, true
		case name == "heartbeat" && v == "false":
			return 0, true
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return 0, false
		}
		return time.Duration(n) * time.Millisecond, true
	}
	var okT, okH bool
	fp.timeout, okT = millis("timeout")
	fp.heartbeat, okH = millis("heartbeat")
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			okT = false
		}
		fp.limit = n
	}
	if !okT || !okH {
		writeJSONError(w, http.StatusBadRequest, "bad_request", "invalid_integer")
		return fp, false
	}
	switch since := q.Get("since"); since {
	case "now":
		fp.since = p.log.last()
	default:
		n, ok := p.log.parse(since)
		if !ok {
			writeJSONError(w, http.StatusBadRequest, "bad_request", "Malformed sequence supplied in 'since' parameter.")
			return fp, false
		}
		fp.since = n
	}
	return fp, true
}

// serveDBUpdates answers GET /_db_updates from the log. normal answers at once; longpoll waits
// for a row after since (or the timeout, 60 s by default); continuous writes a line per row,
// then waits for more, with a newline every heartbeat, until the client leaves, the proxy is
// cut, limit rows were sent or, without heartbeat only (as in CouchDB 3), the timeout passes
// (60 s by default), ending with a {"last_seq"} line in the last two cases. heartbeat applies to
// continuous feeds only.
func (p *UpdatesProxy) serveDBUpdates(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		writeJSONError(w, http.StatusMethodNotAllowed, "method_not_allowed", "Only GET allowed")
		return
	}
	if g := p.gate.Load(); g != nil && r.URL.Query().Has("since") {
		p.waiting.Add(1)
		select {
		case <-*g:
		case <-r.Context().Done():
		}
		p.waiting.Add(-1)
		if r.Context().Err() != nil {
			return
		}
	}
	fp, ok := p.parseFeedParams(w, r)
	if !ok {
		return
	}
	switch {
	case fp.feed == "continuous" && fp.heartbeat > 0:
		fp.timeout = 0 // CouchDB 3 ignores the timeout of a continuous feed with heartbeats
	case fp.feed != "normal" && fp.timeout == 0:
		fp.timeout = defaultFeedTimeout
	}
	var deadline <-chan time.Time
	if fp.timeout > 0 {
		t := time.NewTimer(fp.timeout)
		defer t.Stop()
		deadline = t.C
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "must-revalidate")
	if fp.feed == "continuous" {
		p.streamDBUpdates(w, r, fp, deadline)
		return
	}
	rows, last, changed := p.log.read(fp.since, fp.limit)
	for fp.feed == "longpoll" && len(rows) == 0 && fp.limit != 0 {
		select {
		case <-changed:
			rows, last, changed = p.log.read(fp.since, fp.limit)
			continue
		case <-deadline:
		case <-r.Context().Done():
			return
		}
		break
	}
	var b bytes.Buffer
	b.WriteString("{\"results\":[\n")
	for i, row := range rows {
		if i > 0 {
			b.WriteString(",\n")
		}
		b.Write(p.rowJSON(row))
	}
	b.WriteString("\n],\n\"last_seq\":")
	b.Write(mustJSON(p.log.encode(last)))
	b.WriteString("}\n")
	_, _ = w.Write(b.Bytes())
}

func (p *UpdatesProxy) streamDBUpdates(w http.ResponseWriter, r *http.Request, fp feedParams, deadline <-chan time.Time) {
	rc := http.NewResponseController(w)
	w.WriteHeader(http.StatusOK)
	if rc.Flush() != nil {
		return
	}
	var beat <-chan time.Time
	if fp.heartbeat > 0 {
		t := time.NewTicker(fp.heartbeat)
		defer t.Stop()
		beat = t.C
	}
	since, sent := fp.since, 0
	for {
		left := -1
		if fp.limit >= 0 {
			left = fp.limit - sent
		}
		rows, _, changed := p.log.read(since, left)
		for _, row := range rows {
			if _, err := w.Write(append(p.rowJSON(row), '\n')); err != nil {
				return
			}
			since = row.seq
			sent++
		}
		if rc.Flush() != nil {
			return
		}
		if fp.limit >= 0 && sent >= fp.limit {
			break
		}
		select {
		case <-changed:
			continue
		case <-beat:
			if _, err := w.Write([]byte("\n")); err != nil || rc.Flush() != nil {
				return
			}
			continue
		case <-deadline:
		case <-r.Context().Done():
			return
		}
		break
	}
	_, _ = w.Write(append(append([]byte(`{"last_seq":`), mustJSON(p.log.encode(since))...), "}\n"...))
}

// rowJSON encodes one row as CouchDB 3 does: {"db_name","type","seq"}.
func (p *UpdatesProxy) rowJSON(row updateRow) []byte {
	return mustJSON(struct {
		DBName string `json:"db_name"`
		Type   string `json:"type"`
		Seq    string `json:"seq"`
	}{row.db, row.typ, p.log.encode(row.seq)})
}

// mustJSON encodes a value that always encodes (strings, structs of strings).
func mustJSON(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}

// dbsInfoRow is one element of POST /_dbs_info's answer.
type dbsInfoRow struct {
	Key   string          `json:"key"`
	Info  json.RawMessage `json:"info,omitempty"`
	Error string          `json:"error,omitempty"`
}

// errUpstream is a GET /{db} answer other than 200 or 404; the whole request answers with it.
type errUpstream struct {
	status int
	body   []byte
}

func (e *errUpstream) Error() string { return "server answered " + strconv.Itoa(e.status) }

// serveDBsInfo answers POST /_dbs_info {"keys":[…]} as CouchDB 3 does: in key order, the info of
// each db (GET /{db} on the server with the client's credentials, at most 8 at once) or
// "not_found". More than 100 keys or no keys member is a 400; any other answer of the server
// is passed on as the answer to the whole request.
func (p *UpdatesProxy) serveDBsInfo(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Keys *[]string `json:"keys"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&body); err != nil {
		writeJSONError(w, http.StatusBadRequest, "bad_request", "invalid UTF-8 JSON")
		return
	}
	switch {
	case body.Keys == nil:
		writeJSONError(w, http.StatusBadRequest, "bad_request", "`keys` member must exist.")
		return
	case len(*body.Keys) > maxDBsInfoKeys:
		writeJSONError(w, http.StatusBadRequest, "bad_request", "too_many_keys")
		return
	}
	keys := *body.Keys
	rows := make([]dbsInfoRow, len(keys))
	errs := make([]error, len(keys))
	idx := make(chan int)
	var wg sync.WaitGroup
	for range min(dbsInfoConcurrency, len(keys)) {
		wg.Go(func() {
			for i := range idx {
				rows[i], errs[i] = p.dbInfo(r, keys[i])
			}
		})
	}
	for i := range keys {
		idx <- i
	}
	close(idx)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		var ue *errUpstream
		if errors.As(err, &ue) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(ue.status)
			_, _ = w.Write(ue.body)
			return
		}
		if r.Context().Err() == nil {
			writeJSONError(w, http.StatusBadGateway, "bad_gateway", "couchtest: updates proxy: "+err.Error())
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(mustJSON(rows), '\n'))
}

// dbInfo reads the info of db from the server for the client request r.
func (p *UpdatesProxy) dbInfo(r *http.Request, db string) (dbsInfoRow, error) {
	if db == "" || db[0] == '_' && !systemDBs[db] { // a path that is no db
		return dbsInfoRow{Key: db, Error: "not_found"}, nil
	}
	target := p.target.String() + p.prefix + dbPath(db)
	req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, target, nil)
	if err != nil {
		return dbsInfoRow{}, err
	}
	if auth := r.Header.Get("Authorization"); auth != "" {
		req.Header.Set("Authorization", auth)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := p.transport.RoundTrip(req)
	if err != nil {
		return dbsInfoRow{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return dbsInfoRow{}, err
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return dbsInfoRow{Key: db, Info: bytes.TrimSpace(data)}, nil
	case http.StatusNotFound:
		return dbsInfoRow{Key: db, Error: "not_found"}, nil
	default:
		return dbsInfoRow{}, &errUpstream{status: resp.StatusCode, body: data}
	}
}
