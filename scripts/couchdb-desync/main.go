// Command couchdb-desync reproduces a CouchDB fault that pkg/couch guards against (see
// errorAnswers there, and scripts/README.md, Chaos suite): a normal _changes request on a db
// deleted while it is read can get two answers on one keep-alive connection, so that every later
// request on that connection reads the answer of the request before it.
//
//	COUCHDB_URL=http://admin:pw@127.0.0.1:5984 go run ./scripts/couchdb-desync [-rounds 100]
//
// Each round creates a db (q=1) of 20 small docs whose second doc is large, sends DELETE of the db
// and, 0–15 ms later, GET _changes?include_docs=true on another connection, reads its answer,
// then sends GET / on the same connection: an answer other than CouchDB's welcome, or bytes that
// came unasked before it, is a desync. It speaks HTTP/1.1 by hand over that connection, so that no
// client library drops or hides the extra answer. The dbs are named couchdb_desync_* and are
// deleted. It prints each round, the counts, and the first desync's bytes with the credentials
// redacted.
//
// Apache CouchDB 3.3.3 on a 2-core machine: 6 desyncs in 35 rounds (scripts/README.md). The large
// doc, random so that CouchDB cannot compress it, makes the shard's reader die after its first
// row, before the coordinator sent anything, which is when the changes callback's 500 is
// followed by chttpd's own 500 for fabric_view_changes:go/5's badmatch.
package main

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strings"
	"time"
)

func main() {
	rounds := flag.Int("rounds", 100, "rounds at most")
	stopAfter := flag.Int("stop-after", 5, "stop after this many desyncs")
	bigDoc := flag.Int("big", 7<<20, "bytes of the second doc")
	flag.Parse()
	if err := run(*rounds, *stopAfter, *bigDoc); err != nil {
		fmt.Fprintln(os.Stderr, "couchdb-desync:", err)
		os.Exit(1)
	}
}

type server struct {
	host, auth string // host:port, and the Authorization header's value
	secrets    []string
}

func run(rounds, stopAfter, bigDoc int) error {
	raw := os.Getenv("COUCHDB_URL")
	if raw == "" {
		return errors.New("COUCHDB_URL is unset: name an Apache CouchDB 3, with an admin's credentials")
	}
	u, err := url.Parse(raw)
	if err != nil || u.Scheme != "http" || u.User == nil {
		return errors.New("COUCHDB_URL: want http://user:password@host:port")
	}
	pw, _ := u.User.Password()
	token := base64.StdEncoding.EncodeToString([]byte(u.User.Username() + ":" + pw))
	s := &server{host: u.Host, auth: "Basic " + token, secrets: []string{token, pw}}

	counts := map[string]int{}
	desyncs, done := 0, 0
	var example []byte
	prefix := fmt.Sprintf("couchdb_desync_%d_", time.Now().Unix())
	for i := 0; i < rounds && desyncs < stopAfter; i++ {
		db := fmt.Sprintf("%s%d", prefix, i)
		if err := s.fill(db, bigDoc); err != nil {
			return err
		}
		first, extra, next, err := s.round(db, time.Duration(rand.IntN(15000))*time.Microsecond)
		_, _ = s.do(http.MethodDelete, "/"+db, nil)
		if err != nil {
			return fmt.Errorf("round %d: %w", i, err)
		}
		done++
		counts[first]++
		desync := len(extra) > 0 || next != nil && !bytes.Contains(next, []byte(`{"couchdb":"Welcome"`))
		fmt.Printf("round %3d: _changes answered %s, %d bytes came unasked, desync %v\n", i, first, len(extra), desync)
		if desync {
			desyncs++
			if example == nil {
				example = append(extra, next...)
			}
		}
	}
	fmt.Printf("\n%d rounds, %d desyncs; _changes answered: %v\n", done, desyncs, counts)
	if example != nil {
		fmt.Printf("\nwhat the first desync's connection carried after the _changes answer:\n%s\n", s.redact(example))
	}
	return nil
}

// round sends DELETE /db, then after delay GET /db/_changes on another connection, reads its
// answer, and sends GET / on that connection. It returns the _changes answer's status (with
// "cut" when its body ended early), the bytes that came unasked after it, and what GET / read
// (nil when nothing could be asked or read: the server closed the connection).
func (s *server) round(db string, delay time.Duration) (first string, extra, next []byte, err error) {
	del, err := net.Dial("tcp", s.host)
	if err != nil {
		return "", nil, nil, err
	}
	defer del.Close()
	c, err := net.Dial("tcp", s.host)
	if err != nil {
		return "", nil, nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := io.WriteString(del, s.request(http.MethodDelete, "/"+db)); err != nil {
		return "", nil, nil, err
	}
	time.Sleep(delay)
	if _, err := io.WriteString(c, s.request(http.MethodGet, "/"+db+"/_changes?feed=normal&include_docs=true&style=all_docs")); err != nil {
		return "", nil, nil, err
	}
	br := bufio.NewReaderSize(c, 1<<16)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return "", nil, nil, fmt.Errorf("read the _changes answer: %w", err)
	}
	first = resp.Status
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return first + " (cut)", nil, nil, nil // the connection closed under it: no desync possible
	}
	_ = resp.Body.Close()
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := br.Peek(1); err == nil {
		extra, _ = br.Peek(br.Buffered())
		extra = bytes.Clone(extra)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, s.request(http.MethodGet, "/")); err != nil {
		return first, extra, nil, nil
	}
	if resp, err := http.ReadResponse(br, nil); err == nil {
		next, _ = httputil.DumpResponse(resp, true)
	}
	_ = del.SetDeadline(time.Now().Add(time.Minute))
	if resp, err := http.ReadResponse(bufio.NewReader(del), nil); err == nil {
		_ = resp.Body.Close() // the deletion is done before the next round
	}
	return first, extra, next, nil
}

func (s *server) request(method, path string) string {
	return fmt.Sprintf("%s %s HTTP/1.1\r\nHost: %s\r\nAuthorization: %s\r\nAccept: application/json\r\n\r\n", method, path, s.host, s.auth)
}

// fill creates db with one shard and 20 docs of 100 bytes, the second of bigDoc random bytes.
func (s *server) fill(db string, bigDoc int) error {
	if st, err := s.do(http.MethodPut, "/"+db+"?q=1", nil); err != nil || st != http.StatusCreated {
		return fmt.Errorf("create %s: status %d: %v", db, st, err)
	}
	docs := make([]map[string]any, 20)
	for i := range docs {
		docs[i] = map[string]any{"_id": fmt.Sprintf("doc%02d", i), "payload": strings.Repeat("x", 100)}
	}
	docs[1]["payload"] = filler(bigDoc)
	body, err := json.Marshal(map[string]any{"docs": docs})
	if err != nil {
		return err
	}
	if st, err := s.do(http.MethodPost, "/"+db+"/_bulk_docs", body); err != nil || st != http.StatusCreated {
		return fmt.Errorf("fill %s: status %d: %v", db, st, err)
	}
	return nil
}

// filler returns n random letters and digits: a body CouchDB cannot compress (its snappy would
// make a repeated byte tiny on disk, and its read quick).
func filler(n int) string {
	const chars = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	for i := range b {
		b[i] = chars[rand.IntN(len(chars))]
	}
	return string(b)
}

var client = &http.Client{Timeout: 2 * time.Minute}

func (s *server) do(method, path string, body []byte) (int, error) {
	req, err := http.NewRequest(method, "http://"+s.host+path, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Authorization", s.auth)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return 0, errors.New(s.redact([]byte(err.Error())))
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

func (s *server) redact(b []byte) string {
	out := string(b)
	for _, secret := range s.secrets {
		if secret != "" {
			out = strings.ReplaceAll(out, secret, "xxxxx")
		}
	}
	return out
}
