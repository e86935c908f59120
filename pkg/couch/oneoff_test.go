package couch

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/go-kivik/kivik/v4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// oneAnswerOffServer answers like CouchDB 3.3.3 did on a connection whose _changes request hit
// a db being deleted: first status with body (the changes callback's error answer), and on that
// connection one answer too many from then on (the request handler's own error answer after its
// badmatch in fabric_view_changes:go/5: each later request gets a stale answer before its own).
// A fresh connection answers {"from":"fresh"}.
func oneAnswerOffServer(t *testing.T, status int, body string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close() // idle keep-alive connections of the client
		}
		mu.Unlock()
		wg.Wait()
	})
	answer := func(w io.Writer, status int, body string) {
		fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
			status, http.StatusText(status), len(body), body)
	}
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				br := bufio.NewReader(c)
				off := false
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					_, _ = io.Copy(io.Discard, req.Body)
					switch {
					case req.URL.Path == "/deleted/_changes":
						answer(c, status, body)
						off = true
					case off:
						answer(c, http.StatusOK, `{"from":"stale"}`)
						answer(c, http.StatusOK, `{"from":"this connection"}`)
					default:
						answer(c, http.StatusOK, `{"from":"fresh"}`)
					}
				}
			})
		}
	})
	return "http://" + ln.Addr().String()
}

// CouchDB 3.3.3's log of the run that showed it: the shard's reader killed under the _changes
// read (fabric_rpc:changes exit:{killed,...}), a 500 sent by the changes callback, then req_err
// badmatch {delayed_resp,...} and a second 500. A db found deleted takes the same path with a 404.
// The client's own requests and kivik's share the connections: neither may reuse that one.
func TestConnectionIsNotReusedAfterADeletedDBAnswer(t *testing.T) {
	for _, tc := range []struct {
		status int
		body   string
	}{
		{http.StatusInternalServerError, `{"error":"killed","reason":"{gen_server,call,[<0.19067.3>,{pread_iolist,8527},infinity]}"}`},
		{http.StatusNotFound, `{"error":"not_found","reason":"Database does not exist."}`},
	} {
		for _, by := range []string{"client", "kivik"} {
			t.Run(strconv.Itoa(tc.status)+"/"+by, func(t *testing.T) {
				c, err := New(Config{URL: oneAnswerOffServer(t, tc.status, tc.body), MaxConns: 1}, nil)
				require.NoError(t, err)
				if by == "client" {
					err = c.Do(t.Context(), http.MethodGet, "/deleted/_changes", nil, nil, nil)
					var he *HTTPError
					require.ErrorAs(t, err, &he)
					require.Equal(t, tc.status, he.Status)
				} else {
					changes := c.Kivik().DB("deleted").Changes(t.Context())
					for changes.Next() {
					}
					require.Equal(t, tc.status, kivik.HTTPStatus(changes.Err()))
				}
				for range 3 {
					var got struct{ From string }
					require.NoError(t, c.Do(t.Context(), http.MethodGet, "/other/_bulk_get", nil, nil, &got))
					assert.Equal(t, "fresh", got.From, "an answer meant for another request")
				}
			})
		}
	}
}

// CouchDB 3.3.3's second answer above dumps the request it failed, its Authorization header
// included: neither the client's errors nor kivik's, nor the logs, hold the credentials.
func TestErrorAnswersNeverHoldTheCredentials(t *testing.T) {
	f := newFakeServer(t, crashDump, crashDump)
	url := strings.Replace(f.URL, "http://", "http://admin:SECRETPW@", 1)
	token := base64.StdEncoding.EncodeToString([]byte("admin:SECRETPW"))
	c, logs := newTestClient(t, url)

	err := c.Do(t.Context(), http.MethodGet, "/db/_changes", nil, nil, nil)
	var he *HTTPError
	require.ErrorAs(t, err, &he)
	assert.Contains(t, he.Reason, "'Authorization',\"Basic xxxxx\"", "the reason is kept, redacted")
	_, err2 := c.Kivik().DB("db").Get(t.Context(), "doc").Rev()
	require.Error(t, err2)
	for _, s := range []string{err.Error(), he.Reason, err2.Error(), logs.String()} {
		assert.NotContains(t, s, token)
		assert.NotContains(t, s, "SECRETPW")
	}
}

// crashDump answers as CouchDB 3.3.3 does after a crash in a request's handler (abridged).
func crashDump(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusInternalServerError)
	reason := fmt.Sprintf("{delayed_resp,#Fun<chttpd.3.110512823>,\n {httpd,{mochiweb_request,[#Port<0.60595>,'GET',%q,"+
		"{{\"authorization\",{'Authorization',%q},nil,nil}}]}}}", r.URL.Path, r.Header.Get("Authorization"))
	_ = json.NewEncoder(w).Encode(map[string]any{"error": "badmatch", "reason": reason, "ref": 2278396532})
}
