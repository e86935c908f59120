package couch

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/sirupsen/logrus"
)

// urlStartRE finds where the next URL of a list starts: a comma followed by a scheme.
var urlStartRE = regexp.MustCompile(`,\s*(?i:https?://)`)

// SplitURLs splits a SPIEGEL_COUCHDB_URL value into the URLs of the nodes it lists, in order. A
// comma starts a new URL only where "http://" or "https://" follows it, so a comma inside a
// password stays where it is. Surrounding spaces are trimmed; one URL gives a list of one.
func SplitURLs(raw string) []string {
	var out []string
	for {
		loc := urlStartRE.FindStringIndex(raw)
		if loc == nil {
			break
		}
		out = append(out, strings.TrimSpace(raw[:loc[0]]))
		raw = strings.TrimSpace(raw[loc[0]+1:])
	}
	return append(out, strings.TrimSpace(raw))
}

// node is where one node of the cluster answers: scheme and host[:port].
type node struct{ scheme, host string }

// parseNodes reads the nodes after the first of a URL list: each must be a plain http(s) URL; its
// path and credentials, when given, must be the first URL's, since requests keep the first URL's
// path and credentials on every node.
func parseNodes(first *url.URL, firstUser *url.Userinfo, raws []string) ([]node, error) {
	nodes := []node{{first.Scheme, first.Host}}
	seen := map[node]bool{nodes[0]: true}
	for _, raw := range raws {
		u, user, err := parseBaseURL(raw)
		if err != nil {
			return nil, err
		}
		shown := shownURL(raw)
		if u.Path != first.Path {
			return nil, fmt.Errorf("couchdb url %q: a node's path must be the first URL's (%q)", shown, first.Path)
		}
		if user != nil && (firstUser == nil || user.String() != firstUser.String()) {
			return nil, fmt.Errorf("couchdb url %q: a node's credentials must be the first URL's (or none)", shown)
		}
		n := node{u.Scheme, u.Host}
		if seen[n] {
			return nil, fmt.Errorf("couchdb url %q: node listed twice", shown)
		}
		seen[n] = true
		nodes = append(nodes, n)
	}
	return nodes, nil
}

// failover sends the requests meant for the first node (URLs whose host is the first URL's, as
// every URL the client builds has) to the node in use, and moves to the next node of the list
// when the one in use cannot be reached. It sticks to a node while it answers: no request is
// spread over nodes, and a node that comes back is used again only when the others fail.
// Requests to other hosts (a replication's remote target) pass through untouched.
//
// A request that never reached the node (the connection could not be made) is sent to the next
// node at once, whatever its method. One that failed after it may have been sent (a reset
// connection) is sent again only when it is idempotent and its body can be read again; otherwise
// its error is returned and the next request goes to the next node (the callers retry what they
// may: DoIdempotent, the feeds' reconnects).
type failover struct {
	base    http.RoundTripper
	primary string // the first URL's host, as request URLs carry it
	nodes   []node
	cur     *atomic.Int32 // index of the node in use; shared by the client's transports
	log     logrus.FieldLogger
}

func (f *failover) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Host != f.primary {
		return f.base.RoundTrip(req)
	}
	n := int32(len(f.nodes))
	at := f.cur.Load()
	body := req.Body
	for tried := int32(1); ; tried++ {
		r := req.Clone(req.Context())
		r.Body = body
		r.URL.Scheme, r.URL.Host, r.Host = f.nodes[at].scheme, f.nodes[at].host, ""
		resp, err := f.base.RoundTrip(r)
		if err == nil || req.Context().Err() != nil {
			return resp, err
		}
		unsent := neverSent(err)
		if !unsent && !nodeLost(err) {
			return nil, err
		}
		next := (at + 1) % n
		if f.cur.CompareAndSwap(at, next) {
			f.log.WithFields(logrus.Fields{"from": f.nodes[at].host, "to": f.nodes[next].host, "error": redactErr(err)}).
				Warn("CouchDB node unreachable: using the next node of SPIEGEL_COUCHDB_URL")
		}
		if tried >= n || !unsent && !replayable(req) {
			return nil, err
		}
		if req.Body != nil && req.Body != http.NoBody {
			if req.GetBody == nil {
				return nil, err
			}
			if body, err = req.GetBody(); err != nil {
				return nil, err
			}
		}
		at = f.cur.Load()
	}
}

// CloseIdleConnections passes the call on, so that the wrapped transport's idle connections can
// be released.
func (f *failover) CloseIdleConnections() {
	if c, ok := f.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// neverSent reports whether err says no connection was made, so nothing of the request reached
// the node.
func neverSent(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial" || errors.Is(err, syscall.ECONNREFUSED)
}

// nodeLost reports whether err is the loss of a connection to the node (reset, closed before an
// answer).
func nodeLost(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// replayable reports whether req may be sent a second time: an idempotent method whose body, if
// any, can be read again.
func replayable(req *http.Request) bool {
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodPut, http.MethodDelete:
	default:
		return false
	}
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}

func redactErr(err error) string { return redact(err).Error() }

// NodeInUse returns the host of the node the client sends its requests to (the first URL's
// until it fails; see failover).
func (c *Client) NodeInUse() string {
	if c.nodes == nil {
		return c.base.Host
	}
	return c.nodes.nodes[c.nodes.cur.Load()].host
}
