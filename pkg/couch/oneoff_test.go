package couch

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"

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
func TestConnectionIsNotReusedAfterADeletedDBAnswer(t *testing.T) {
	for _, tc := range []struct {
		status int
		body   string
	}{
		{http.StatusInternalServerError, `{"error":"unknown_error","reason":"killed"}`},
		{http.StatusNotFound, `{"error":"not_found","reason":"Database does not exist."}`},
	} {
		t.Run(strconv.Itoa(tc.status), func(t *testing.T) {
			c, err := New(Config{URL: oneAnswerOffServer(t, tc.status, tc.body), MaxConns: 1}, nil)
			require.NoError(t, err)
			err = c.Do(t.Context(), http.MethodGet, "/deleted/_changes", nil, nil, nil)
			var he *HTTPError
			require.ErrorAs(t, err, &he)
			require.Equal(t, tc.status, he.Status)
			for range 3 {
				var got struct{ From string }
				require.NoError(t, c.Do(t.Context(), http.MethodGet, "/other/_bulk_get", nil, nil, &got))
				assert.Equal(t, "fresh", got.From, "an answer meant for another request")
			}
		})
	}
}
