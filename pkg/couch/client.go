// Package couch is the CouchDB client every binary uses: one HTTP transport (compression off, so
// that continuous feeds stream on PouchDB Server too), a kivik client over it, a JSON request
// helper with redacted errors, db listing and info, the _changes of one db, and the db-updates
// feed in its three forms (_db_updates, _global_changes, polling).
//
// Requests go through Do, DoIdempotent and Send (raw JSON over one shared transport) and, for
// documents of the spiegel db, through the kivik client over the same transport. The native
// engine's bulk calls stay raw: measured against kivik on PouchDB Server 4.2 and CouchDB 3.3.3
// (BenchmarkKivikVersusRaw), kivik was 1.1–1.4× slower for db info, _revs_diff, _bulk_get and
// _bulk_docs on PouchDB and no faster on CouchDB, and it cannot read PouchDB Server's open_revs
// answer.
//
// Sequence values are opaque strings end to end (see Seq). No error or log line of this package
// holds the password of the configured URL.
package couch

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-kivik/kivik/v4"
	"github.com/go-kivik/kivik/v4/couchdb"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/couchpath"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// DefaultRequestTimeout bounds every non-feed request made through Do when Config.RequestTimeout
// is zero.
const DefaultRequestTimeout = 30 * time.Second

// Config of the watched server.
type Config struct {
	// URL is the base URL with admin credentials, e.g. http://admin:pw@127.0.0.1:5984. It may
	// have a path prefix (a reverse proxy). It may list the nodes of one cluster, comma-separated
	// (see SplitURLs): requests go to the first node until it cannot be reached, then to the
	// next (see failover). Never log it: use Client.Redacted.
	URL string
	// CAFile is an optional PEM CA bundle trusted for https, in addition to the system roots.
	CAFile string
	// InsecureSkipVerify turns off TLS certificate verification (tests only).
	InsecureSkipVerify bool
	// RequestTimeout bounds each non-feed request made through Do; 0 means 30s.
	RequestTimeout time.Duration
	// MaxConns caps the connections a transport of the client's own opens to one host for
	// requests: more requests at once wait for a free connection. Continuous feeds and streams
	// (SendStream) go over a second, uncapped transport: each holds its connection for as long
	// as it runs, and their number is bounded by design (SPEC §7.3). 0 means no cap. Ignored
	// when Transport is set.
	MaxConns int
	// Transport, when set, carries every request instead of a transport of the client's own
	// (CAFile and InsecureSkipVerify are then the transport's business): clients of many
	// servers or dbs can share one connection pool. It must not compress (see NewTransport).
	Transport http.RoundTripper
	// StreamTransport, when set with Transport, carries the continuous feeds and SendStream's
	// requests (see MaxConns); by default Transport does.
	StreamTransport http.RoundTripper
}

// NewTransport returns the transport New makes for cfg's requests: compression off (gzip stalls
// PouchDB Server's continuous feeds), cfg's TLS settings, a pool of 64 idle connections per host,
// at most cfg.MaxConns connections per host (0: no cap). An idle connection closes after 30 s:
// the extra ones a burst opened (an initial sync holds two per running replication) would
// otherwise stay open, each a process in CouchDB, for 90 s into the quieter work after it (at
// 10,000 dbs they were 39 of the 51 connections at the start of the writes).
func NewTransport(cfg Config) (*http.Transport, error) {
	tlsConf, err := tlsConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:       tlsConf,
		TLSHandshakeTimeout:   10 * time.Second,
		DisableCompression:    true,
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   64,
		MaxConnsPerHost:       max(cfg.MaxConns, 0),
		IdleConnTimeout:       30 * time.Second,
		ExpectContinueTimeout: time.Second,
	}, nil
}

// Client talks to one CouchDB (or PouchDB Server). It is safe for concurrent use; all its HTTP
// traffic, kivik's included, shares one connection pool.
type Client struct {
	log      logrus.FieldLogger
	base     *url.URL // without user info, no trailing slash; of the first node
	user     *url.Userinfo
	nodes    *failover // nil: one node
	redacted string
	timeout  time.Duration
	tr       http.RoundTripper // under http's PlusSafe wrapper
	http     *http.Client      // requests; no overall timeout (Do sets one per request)
	streams  *http.Client      // continuous feeds and SendStream: uncapped when requests are capped
	kivik    *kivik.Client
	retry    backoff.Policy // reconnect policy of the feeds

	serverMu sync.Mutex
	server   *ServerInfo

	noDBsInfo atomic.Bool  // the server lacks POST /_dbs_info
	malformed atomic.Int64 // feed lines skipped because they did not decode
}

// New validates cfg and builds the client. It does not contact the server. The error for a bad
// URL names the URL with its password redacted.
func New(cfg Config, log logrus.FieldLogger) (*Client, error) {
	if log == nil {
		l := logrus.New()
		l.SetOutput(io.Discard)
		log = l
	}
	urls := SplitURLs(cfg.URL)
	base, user, err := parseBaseURL(urls[0])
	if err != nil {
		return nil, err
	}
	var nodes []node
	if len(urls) > 1 {
		if nodes, err = parseNodes(base, user, urls[1:]); err != nil {
			return nil, err
		}
	}
	var tr, streamTr http.RoundTripper = cfg.Transport, cmp.Or(cfg.StreamTransport, cfg.Transport)
	if tr == nil {
		own, err := NewTransport(cfg)
		if err != nil {
			return nil, err
		}
		tr, streamTr = own, own
		if own.MaxConnsPerHost > 0 {
			// A feed holds its connection for as long as it runs: under the cap, feeds would
			// starve requests (and requests a reconnecting feed).
			st := own.Clone()
			st.MaxConnsPerHost = 0
			streamTr = st
		}
	}
	var fo *failover
	if len(nodes) > 1 {
		cur := new(atomic.Int32)
		flog := log.WithField("component", "couch")
		fo = &failover{base: tr, primary: base.Host, nodes: nodes, cur: cur, log: flog}
		tr = fo
		streamTr = &failover{base: streamTr, primary: base.Host, nodes: nodes, cur: cur, log: flog}
	}
	timeout := cfg.RequestTimeout
	if timeout <= 0 {
		timeout = DefaultRequestTimeout
	}
	rt := errorAnswers{couchpath.PlusSafe(tr)} // kivik leaves '+' in db names unescaped
	c := &Client{
		log:      log.WithField("component", "couch"),
		base:     base,
		user:     user,
		nodes:    fo,
		redacted: redactURLs(urls),
		timeout:  timeout,
		tr:       tr,
		http:     &http.Client{Transport: rt},
		streams:  &http.Client{Transport: errorAnswers{couchpath.PlusSafe(streamTr)}},
		retry:    backoff.Default,
	}
	// kivik gets its own http.Client over the same transport: its auth option wraps the
	// client's transport, which must not leak into ours.
	opts := []kivik.Option{
		couchdb.OptionHTTPClient(&http.Client{Transport: rt}),
		couchdb.OptionNoRequestCompression(),
	}
	if user != nil {
		pw, _ := user.Password()
		opts = append(opts, couchdb.BasicAuth(user.Username(), pw))
	}
	k, err := kivik.New("couch", base.String(), opts...)
	if err != nil {
		return nil, fmt.Errorf("create kivik client for %s: %w", c.redacted, redact(err))
	}
	c.kivik = k
	return c, nil
}

// shownURL returns raw fit for an error message: redacted when it parses as a URL with a host,
// otherwise with everything before its last '@' (where a password may hide) replaced.
func shownURL(raw string) string {
	if u, err := url.Parse(raw); err == nil && u.Host != "" {
		return logging.RedactURL(raw)
	}
	if i := strings.LastIndex(raw, "@"); i >= 0 {
		return "xxxxx" + raw[i:]
	}
	return logging.RedactText(raw)
}

func parseBaseURL(raw string) (*url.URL, *url.Userinfo, error) {
	shown := shownURL(raw)
	if strings.TrimSpace(raw) == "" {
		return nil, nil, errors.New("couchdb url is empty")
	}
	u, err := url.Parse(raw)
	if err != nil {
		// url's error quotes the input: never wrap it.
		return nil, nil, fmt.Errorf("couchdb url %q does not parse", shown)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, nil, fmt.Errorf("couchdb url %q: scheme must be http or https", shown)
	}
	if u.Host == "" {
		return nil, nil, fmt.Errorf("couchdb url %q: no host", shown)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return nil, nil, fmt.Errorf("couchdb url %q: must not have a query or fragment", shown)
	}
	user := u.User
	u.User = nil
	u.Path = strings.TrimRight(u.Path, "/")
	u.RawPath = strings.TrimRight(u.RawPath, "/")
	return u, user, nil
}

func tlsConfig(cfg Config) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: cfg.InsecureSkipVerify} //nolint:gosec // opt-in
	if cfg.CAFile == "" {
		return tc, nil
	}
	pem, err := os.ReadFile(cfg.CAFile)
	if err != nil {
		return nil, fmt.Errorf("read couchdb CA file: %w", err)
	}
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("couchdb CA file %s holds no PEM certificate", cfg.CAFile)
	}
	tc.RootCAs = pool
	return tc, nil
}

// RequestTimeout returns the bound of one non-feed request (Config.RequestTimeout). Give calls
// made through Kivik a context with this deadline.
func (c *Client) RequestTimeout() time.Duration { return c.timeout }

// Kivik returns the kivik client over the shared transport. kivik calls have no timeout of
// their own: give them a context deadline.
func (c *Client) Kivik() *kivik.Client { return c.kivik }

// HTTPClient returns the plain HTTP client over the shared transport of requests (capped by
// Config.MaxConns), with no overall timeout. Requests to URLs built from BaseURL carry its credentials; NewRequest does the
// same without putting them in the URL.
func (c *Client) HTTPClient() *http.Client { return c.http }

// StreamHTTPClient returns the HTTP client of continuous feeds and SendStream: outside the cap of
// Config.MaxConns, with no overall timeout.
func (c *Client) StreamHTTPClient() *http.Client { return c.streams }

// CloseIdleConnections closes the connections of the client's pools that carry no request
// now; running requests and feeds keep theirs.
func (c *Client) CloseIdleConnections() {
	c.http.CloseIdleConnections()
	c.streams.CloseIdleConnections()
}

// BaseURL returns a copy of the server URL with its credentials. Never log it.
func (c *Client) BaseURL() *url.URL {
	u := *c.base
	if c.user != nil {
		uu := *c.user
		u.User = &uu
	}
	return &u
}

// Redacted returns the server URL with its password replaced: safe for logs and errors.
func (c *Client) Redacted() string { return c.redacted }

// MalformedLines returns how many feed lines were skipped, since the client was built, because
// they did not decode.
func (c *Client) MalformedLines() int64 { return c.malformed.Load() }

// DBPath returns the request path of db: "/" and the name escaped as one path segment (see
// couchpath.Segment).
func (c *Client) DBPath(db string) string { return "/" + couchpath.Segment(db) }

// NewRequest builds a request for path (already escaped, starting with "/") and query on the
// server, with the credentials as a Basic Authorization header (never in the URL), Accept JSON,
// and Content-Type JSON when body is not nil.
func (c *Client) NewRequest(ctx context.Context, method, path string, query url.Values, body io.Reader) (*http.Request, error) {
	target := c.base.String() + path
	if len(query) > 0 {
		target += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, target, body)
	if err != nil {
		return nil, fmt.Errorf("build request %s %s: %w", method, path, redact(err))
	}
	if c.user != nil {
		pw, _ := c.user.Password()
		req.SetBasicAuth(c.user.Username(), pw)
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req, nil
}

// ServerInfo describes the server from its welcome document (GET /).
type ServerInfo struct {
	Vendor  string // vendor.name, e.g. "The Apache Software Foundation", "PouchDB authors"
	Version string // e.g. "3.3.3", "4.2.0"
	PouchDB bool   // PouchDB Server (express-pouchdb)
	CouchDB bool   // Apache CouchDB (or a compatible server that is not PouchDB)
	Major   int    // leading number of Version, 0 when it has none
}

// Server returns the server's welcome info. The first success is cached for the client's life;
// failures are not.
func (c *Client) Server(ctx context.Context) (ServerInfo, error) {
	c.serverMu.Lock()
	defer c.serverMu.Unlock()
	if c.server != nil {
		return *c.server, nil
	}
	var root struct {
		CouchDB string `json:"couchdb"`
		PouchDB string `json:"express-pouchdb"`
		Version string `json:"version"`
		Vendor  struct {
			Name string `json:"name"`
		} `json:"vendor"`
	}
	if err := c.Do(ctx, http.MethodGet, "/", nil, nil, &root); err != nil {
		return ServerInfo{}, fmt.Errorf("read server info of %s: %w", c.redacted, err)
	}
	info := ServerInfo{Vendor: root.Vendor.Name, Version: root.Version}
	info.PouchDB = root.PouchDB != "" || strings.Contains(root.Vendor.Name, "PouchDB")
	info.CouchDB = !info.PouchDB && root.CouchDB != ""
	major, _, _ := strings.Cut(root.Version, ".")
	info.Major, _ = strconv.Atoi(major)
	c.server = &info
	return info, nil
}

// redactURLs returns the URLs, passwords replaced, comma-separated.
func redactURLs(urls []string) string {
	out := make([]string, len(urls))
	for i, u := range urls {
		out[i] = logging.RedactURL(u)
	}
	return strings.Join(out, ",")
}
