package chaos

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/webhook"
)

// sinkMode is what the sink does with every request during a fault.
type sinkMode int

const (
	sinkNormal sinkMode = iota
	sinkFail            // 500 to everything
	sinkStall           // answer only after the rule's timeout
)

// delivery is one change the sink acknowledged with 200 while the client still waited.
type delivery struct {
	DB, ID, Rev, Seq string
}

// sink is the webhook receiver of the on_change rules: ruleHook calls /hook/<db>, ruleSlow (block
// rule of a few dbs) /slow/<db>. It checks Basic auth (user "hook" and the current or previous
// password of the passwords file: see rotate), records every request (when it arrived and when
// it was answered, by which instance), and answers 500 or stalls a fraction of them: always
// during a fault period (setMode), and outside one for the fraction the config names, decided by
// a hash of the seed, the rule, the change and its attempt number (the same requests fail in a
// replay). A stalled request is answered after stallFor, longer than the rules' timeout, unless
// the client gave up first. Every other request of ruleSlow is answered after slowFor (shorter
// than the timeout), so that its jobs last several AckWaits.
type sink struct {
	ln       net.Listener
	srv      *http.Server
	seed     uint64
	fail     float64
	stall    float64
	stallFor time.Duration
	slowFor  time.Duration
	pwFile   string
	journal  *journal // sink.log: every request and its answer

	mu        sync.Mutex
	passwords []string // by generation; the last is current
	mode      sinkMode
	attempts  map[string]int
	ok        map[delivery]int        // 200 answers per change (ruleHook)
	slowOK    map[[3]string]int       // 200 answers per (db, doc id, rev) of ruleSlow
	firstOK   map[[3]string]time.Time // first 200 answer per (db, doc id, rev)
	status    map[string]int          // answers by kind
	okByGen   map[int]int             // 200 answers by password generation
	badBodies []string
	calls     []sinkCall // every request, in arrival order
}

// sinkCall is one request: when it arrived and when the sink answered it (or saw the client
// give up), from which instance (X-Spiegel-Instance), for which rule (hookPath or slowPath) and
// change, with its X-Spiegel-Delivery id. The lease verdict (lease.go) and the overlap verdict
// (overlap.go) read them. End is zero while the request is in progress.
type sinkCall struct {
	At, End     time.Time
	Instance    string
	Rule        string
	Delivery    string
	DB, ID, Rev string
}

// The sink's paths, one per on_change webhook rule: the rule a call is for.
const (
	hookPath = "hook" // ruleHook
	slowPath = "slow" // ruleSlow
)

const hookUser = "hook"

// startSink listens on a loopback port and writes the first passwords file into dir.
// ruleTimeout is the rules' timeout; slowFor how long ruleSlow's requests take.
func startSink(cfg Config, dir string, ruleTimeout, slowFor time.Duration, j *journal) (*sink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &sink{ln: ln, seed: cfg.Seed, fail: cfg.SinkFail, stall: cfg.SinkStall, stallFor: ruleTimeout + time.Second, slowFor: slowFor,
		pwFile: filepath.Join(dir, "passwords.json"), journal: j, attempts: map[string]int{}, ok: map[delivery]int{},
		status: map[string]int{}, okByGen: map[int]int{}, firstOK: map[[3]string]time.Time{}, slowOK: map[[3]string]int{}}
	if err := s.rotate(); err != nil {
		_ = ln.Close()
		return nil, err
	}
	s.srv = &http.Server{Handler: http.HandlerFunc(s.serve), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// addr is the sink's host:port.
func (s *sink) addr() string { return s.ln.Addr().String() }

// close stops the sink.
func (s *sink) close() { _ = s.srv.Close() }

// setMode starts or ends a fault period.
func (s *sink) setMode(m sinkMode) {
	s.mu.Lock()
	s.mode = m
	s.mu.Unlock()
}

// rotate makes a new random password current and rewrites the passwords file atomically (the
// consumers read it on SIGHUP). The previous password stays accepted, for requests built
// before a consumer reloaded; older ones are refused with 401. Passwords are never shown.
func (s *sink) rotate() error {
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		return err
	}
	pw := "hookS3cret-" + hex.EncodeToString(b)
	data, err := json.Marshal(map[string]map[string]string{s.addr(): {hookUser: pw}})
	if err != nil {
		return err
	}
	tmp := s.pwFile + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	s.mu.Lock()
	s.passwords = append(s.passwords, pw)
	s.mu.Unlock()
	return os.Rename(tmp, s.pwFile)
}

// generation is the number of the current password (1 = the first).
func (s *sink) generation() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.passwords)
}

// hookBody is what the on_change rule sends (params change, db, seq).
type hookBody struct {
	DB     string `json:"db"`
	Change struct {
		ID      string `json:"id"`
		Changes []struct {
			Rev string `json:"rev"`
		} `json:"changes"`
	} `json:"change"`
	Seq json.RawMessage `json:"seq"`
}

func (s *sink) serve(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	body, _ := io.ReadAll(r.Body)
	user, pw, _ := r.BasicAuth()
	var b hookBody
	decodeErr := json.Unmarshal(body, &b)
	rule := hookPath
	if strings.HasPrefix(r.URL.Path, "/"+slowPath+"/") {
		rule = slowPath
	}

	s.mu.Lock()
	call := sinkCall{At: arrived, Instance: r.Header.Get(webhook.InstanceHeader), Rule: rule,
		Delivery: r.Header.Get(webhook.DeliveryHeader), DB: b.DB, ID: b.Change.ID}
	if len(b.Change.Changes) > 0 {
		call.Rev = b.Change.Changes[0].Rev
	}
	i := len(s.calls)
	s.calls = append(s.calls, call)
	// answered records, with s.mu held, that the request is over: before the answer is
	// written, so that whatever the client does after it comes later.
	answered := func() { s.calls[i].End = time.Now() }
	gen := 0
	for i := len(s.passwords) - 1; i >= 0 && i >= len(s.passwords)-2; i-- {
		if user == hookUser && pw == s.passwords[i] {
			gen = i + 1
		}
	}
	if gen == 0 {
		s.journal.printf("401 user=%q", user)
		s.status["401"]++
		answered()
		s.mu.Unlock()
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	if decodeErr != nil || b.DB == "" || b.Change.ID == "" || len(b.Change.Changes) == 0 {
		s.journal.printf("400 %q", body[:min(len(body), 200)])
		s.status["400"]++
		if len(s.badBodies) < 5 {
			s.badBodies = append(s.badBodies, string(body[:min(len(body), 300)]))
		}
		answered()
		s.mu.Unlock()
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	d := delivery{DB: b.DB, ID: b.Change.ID, Rev: b.Change.Changes[0].Rev, Seq: string(b.Seq)}
	key := d.DB + "\x00" + d.ID + "\x00" + d.Rev
	if rule == slowPath {
		key = slowPath + "\x00" + key // its own attempts and draws: ruleHook's stay as they were
	}
	s.attempts[key]++
	mode := s.mode
	if mode == sinkNormal {
		switch x := s.fraction(key, s.attempts[key]); {
		case x < s.fail:
			mode = sinkFail
		case x < s.fail+s.stall:
			mode = sinkStall
		}
	}
	s.journal.printf("%s %s %s %s %s seq=%s attempt=%d gen=%d", [...]string{"200", "500", "stall"}[mode], rule, d.DB, d.ID, d.Rev, d.Seq, s.attempts[key], gen)
	wait := time.Duration(0)
	switch {
	case mode == sinkFail:
		s.status["500"]++
		answered()
		s.mu.Unlock()
		w.WriteHeader(http.StatusInternalServerError)
		return
	case mode == sinkStall:
		s.status["stalled"]++
		wait = s.stallFor
	case rule == slowPath:
		wait = s.slowFor
	}
	if wait > 0 {
		s.mu.Unlock()
		select {
		case <-time.After(wait):
		case <-r.Context().Done():
			s.mu.Lock()
			answered()
			s.mu.Unlock()
			s.journal.printf("gave up %s %s %s %s seq=%s", rule, d.DB, d.ID, d.Rev, d.Seq)
			return // the client gave up: not a delivery
		}
		if mode == sinkStall {
			s.journal.printf("200 after stall %s %s %s %s seq=%s", rule, d.DB, d.ID, d.Rev, d.Seq)
		}
		s.mu.Lock()
	}
	s.status["200"]++
	if rule == slowPath {
		s.slowOK[[3]string{d.DB, d.ID, d.Rev}]++
	} else {
		s.ok[d]++
		if k := [3]string{d.DB, d.ID, d.Rev}; s.firstOK[k].IsZero() {
			s.firstOK[k] = time.Now()
		}
	}
	s.okByGen[gen]++
	answered()
	s.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

// fraction maps (seed, change, attempt) to [0, 1), uniformly: attempts of one change are
// independent draws.
func (s *sink) fraction(key string, attempt int) float64 {
	h := sha256.Sum256(fmt.Appendf(nil, "%d\x00%s\x00%d", s.seed, key, attempt))
	return float64(binary.BigEndian.Uint64(h[:8])>>11) / (1 << 53)
}

// allCalls returns every request so far, in arrival order.
func (s *sink) allCalls() []sinkCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]sinkCall(nil), s.calls...)
}

// slowCalls returns the requests of ruleSlow so far, in arrival order: what an aimed fault
// (blockjob.go) looks at while it waits for a long block job.
func (s *sink) slowCalls() []sinkCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []sinkCall
	for _, c := range s.calls {
		if c.Rule == slowPath {
			out = append(out, c)
		}
	}
	return out
}

// firstDelivered returns when each (db, doc id, rev) was first answered 200.
func (s *sink) firstDelivered() map[[3]string]time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.firstOK)
}

// slowDelivered returns the number of ruleSlow's 200 answers per (db, doc id, rev).
func (s *sink) slowDelivered() map[[3]string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.slowOK)
}

// delivered returns the number of ruleHook's 200 answers per (db, doc id, rev), seqs merged.
func (s *sink) delivered() map[[3]string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[[3]string]int{}
	for d, n := range s.ok {
		out[[3]string{d.DB, d.ID, d.Rev}] += n
	}
	return out
}

// stats returns the answers by kind, the 200s by password generation, and bad bodies.
func (s *sink) stats() (status map[string]int, okByGen map[int]int, bad []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	status, okByGen = map[string]int{}, map[int]int{}
	for k, v := range s.status {
		status[k] = v
	}
	for k, v := range s.okByGen {
		okByGen[k] = v
	}
	return status, okByGen, append([]string(nil), s.badBodies...)
}
