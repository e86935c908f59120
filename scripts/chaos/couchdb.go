package chaos

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/freeport"
)

// couchServer is the CouchDB of the run: its own PouchDB Server on disk (a restart keeps the
// data), or any CouchDB named by CHAOS_COUCHDB_URL, restarted only through
// CHAOS_COUCHDB_RESTART_CMD; without that command the Spiegel processes reach an external
// server through an outageProxy, and the restart fault is an outage of the proxy.
//
// CHAOS_COUCHDB_URL may list the nodes of a cluster, comma-separated: the Spiegel processes get
// the whole list (through one outage proxy per node without a restart command), and the run's
// own requests (writer, oracle, probes) go to the last node, which the kill-couchdb-node fault
// never kills.
type couchServer struct {
	url        string         // with credentials, no trailing slash: never print it
	nodes      []string       // every node's URL with the first one's credentials (one: url)
	pouch      *proc          // own PouchDB Server; nil for an external server
	proxies    []*outageProxy // external server without a restart command: one per node; else nil
	procURL    string         // SPIEGEL_COUCHDB_URL of the Spiegel processes: the node list, or the proxies'
	restartCmd string
	nodeCmd    string
	isPouch    bool
	http       *http.Client
	run        *run
}

// startCouch starts or connects to the run's CouchDB and waits until it answers.
func startCouch(ctx context.Context, r *run) (*couchServer, error) {
	s := &couchServer{run: r, restartCmd: r.cfg.CouchRestartCmd, nodeCmd: r.cfg.CouchNodeCmd,
		http: &http.Client{Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64}}}
	if r.cfg.CouchURL != "" {
		var err error
		if s.nodes, err = nodeURLs(r.cfg.CouchURL); err != nil {
			return nil, err
		}
		s.url = s.nodes[len(s.nodes)-1]
		s.procURL = strings.Join(s.nodes, ",")
		if s.restartCmd == "" {
			proxied := make([]string, len(s.nodes))
			for i, node := range s.nodes {
				u, _ := url.Parse(node) // nodeURLs parsed it
				p, err := startOutageProxy(u.Host)
				if err != nil {
					s.closeProxies()
					return nil, err
				}
				s.proxies = append(s.proxies, p)
				if proxied[i], err = p.url(node); err != nil {
					s.closeProxies()
					return nil, err
				}
			}
			s.procURL = strings.Join(proxied, ",")
		}
	} else {
		tools, err := installPouchDisk(ctx, r)
		if err != nil {
			return nil, err
		}
		ports, err := freeport.Ports(1)
		if err != nil {
			return nil, err
		}
		dir := filepath.Join(r.cfg.OutDir, "couchdb")
		if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
			return nil, err
		}
		s.url = fmt.Sprintf("http://127.0.0.1:%d", ports[0])
		s.procURL = s.url
		s.pouch = &proc{name: "pouchdb-server", path: "node", dir: dir, env: os.Environ(), run: r,
			args: []string{"--unhandled-rejections=warn", filepath.Join(tools, "node_modules", "pouchdb-server", "bin", "pouchdb-server"),
				"-d", filepath.Join(dir, "data") + "/", "-o", "127.0.0.1", "-p", fmt.Sprint(ports[0]), "-n"},
			logPath: filepath.Join(r.logDir, "pouchdb-server.log"), ready: s.url + "/"}
		if err := s.pouch.start(); err != nil {
			return nil, err
		}
	}
	var root struct {
		Version string `json:"version"`
		PouchDB string `json:"express-pouchdb"`
		Vendor  struct {
			Name string `json:"name"`
		} `json:"vendor"`
	}
	err := waitUntil(ctx, 30*time.Second, 100*time.Millisecond, "CouchDB answering", func() bool {
		status, err := s.do(ctx, http.MethodGet, "/", nil, &root)
		return err == nil && status == http.StatusOK
	})
	if err != nil {
		return nil, err
	}
	s.isPouch = root.PouchDB != "" || strings.Contains(root.Vendor.Name, "PouchDB")
	return s, nil
}

// nodeURLs splits a CHAOS_COUCHDB_URL into its nodes' URLs (couch.SplitURLs), each without a
// trailing slash and with the first URL's credentials when it has none.
func nodeURLs(raw string) ([]string, error) {
	var first *url.Userinfo
	var out []string
	for i, node := range couch.SplitURLs(raw) {
		u, err := url.Parse(strings.TrimRight(node, "/"))
		if err != nil || u.Host == "" {
			return nil, fmt.Errorf("CHAOS_COUCHDB_URL: node %d does not parse as a URL", i+1) // never print it: it has the password
		}
		if i == 0 {
			first = u.User
		} else if u.User == nil {
			u.User = first
		}
		out = append(out, u.String())
	}
	return out, nil
}

// closeProxies stops the outage proxies.
func (s *couchServer) closeProxies() {
	for _, p := range s.proxies {
		p.close()
	}
}

// killNode runs the node command to kill node i (0-based), waits down, starts it again and
// waits until it answers. mark is called once the kill command returned.
func (s *couchServer) killNode(ctx context.Context, i int, down time.Duration, mark func()) error {
	node := func(ctx context.Context, action string) error {
		cmd := exec.CommandContext(ctx, "sh", "-c", s.nodeCmd)
		cmd.Env = append(os.Environ(), "CHAOS_NODE_ACTION="+action, fmt.Sprintf("CHAOS_NODE=%d", i+1))
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("CHAOS_COUCHDB_NODE_CMD (%s node %d): %v: %s", action, i+1, err, bytes.TrimSpace(out))
		}
		return nil
	}
	if err := node(ctx, "kill"); err != nil {
		return err
	}
	mark()
	werr := sleepCtx(ctx, down)
	// Started even when ctx ended: the run's clean-up and the next run need the node.
	if err := node(context.WithoutCancel(ctx), "start"); err != nil {
		return err
	}
	bctx := context.WithoutCancel(ctx)
	err := waitUntil(bctx, 120*time.Second, 200*time.Millisecond, fmt.Sprintf("CouchDB node %d back", i+1), func() bool {
		req, err := http.NewRequestWithContext(bctx, http.MethodGet, s.nodes[i]+"/_up", nil)
		if err != nil {
			return false
		}
		resp, err := s.http.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return errors.Join(werr, err)
}

// describe says which server this is and whether it can be restarted; it never shows the
// credentials.
func (s *couchServer) describe() string {
	u, _ := url.Parse(s.url)
	host := u.Host
	kind := "Apache CouchDB"
	if s.isPouch {
		kind = "PouchDB Server"
	}
	switch {
	case s.pouch != nil:
		return fmt.Sprintf("%s on disk at %s (started by the run; restart fault on)", kind, host)
	case len(s.nodes) > 1:
		restart := "restart fault runs CHAOS_COUCHDB_RESTART_CMD"
		if s.restartCmd == "" {
			restart = "restart fault: an outage of every node at its proxy"
		}
		kill := "no node kills: CHAOS_COUCHDB_NODE_CMD unset"
		if s.nodeCmd != "" {
			kill = "kill-couchdb-node runs CHAOS_COUCHDB_NODE_CMD on any node but the last"
		}
		return fmt.Sprintf("%s cluster of %d nodes (CHAOS_COUCHDB_URL; the processes get every node, the run's own requests go to the last, %s; %s; %s)",
			kind, len(s.nodes), host, restart, kill)
	case s.restartCmd != "":
		return fmt.Sprintf("%s at %s (CHAOS_COUCHDB_URL; restart fault runs CHAOS_COUCHDB_RESTART_CMD)", kind, host)
	default:
		return fmt.Sprintf("%s at %s (CHAOS_COUCHDB_URL; the run does not restart a server it did not start: the restart fault "+
			"cuts the Spiegel processes' connections at a proxy and refuses new ones for its down time instead; "+
			"set CHAOS_COUCHDB_RESTART_CMD to restart the server itself)", kind, host)
	}
}

// schedulerNote warns when an external Apache CouchDB's replication scheduler is full already:
// the couchdb engine's POST /_replicate then waits for a slot (minutes on a server that runs
// hundreds of other replications), and the run cannot converge. "" when there is room, or on
// PouchDB Server.
func (s *couchServer) schedulerNote(ctx context.Context) string {
	if s.pouch != nil || s.isPouch {
		return ""
	}
	var jobs struct {
		Total int `json:"total_rows"`
	}
	if status, err := s.do(ctx, http.MethodGet, "/_scheduler/jobs?limit=0", nil, &jobs); err != nil || status != http.StatusOK {
		return ""
	}
	maxJobs := 500 // CouchDB's default [replicator] max_jobs
	var v string
	if status, err := s.do(ctx, http.MethodGet, "/_node/_local/_config/replicator/max_jobs", nil, &v); err == nil && status == http.StatusOK {
		if n, err := strconv.Atoi(v); err == nil && n > 0 {
			maxJobs = n
		}
	}
	if jobs.Total < maxJobs {
		return ""
	}
	return fmt.Sprintf("WARNING: the server's replication scheduler holds %d jobs already (max_jobs %d): the couchdb engine's "+
		"POST /_replicate waits for a free slot, so replication may not converge in time (not a fault of the run)", jobs.Total, maxJobs)
}

// restartWhat names what the restart fault does to this server.
func (s *couchServer) restartWhat(term bool) string {
	switch {
	case len(s.proxies) > 1:
		return "CouchDB outage of every node at its proxy (connections cut, new ones refused; the shared servers are not restarted)"
	case s.proxies != nil:
		return "CouchDB outage at the proxy (connections cut, new ones refused; the shared server is not restarted)"
	case s.pouch == nil:
		return "CHAOS_COUCHDB_RESTART_CMD"
	case term:
		return "SIGTERM CouchDB"
	default:
		return "SIGKILL CouchDB"
	}
}

// restart stops the server (SIGTERM or SIGKILL), waits down, starts it again and waits until
// it answers. With an external server it runs the restart command instead, or, without one,
// makes the proxy refuse the Spiegel processes for down.
func (s *couchServer) restart(ctx context.Context, term bool, down time.Duration) error {
	if s.proxies != nil {
		errs := make([]error, len(s.proxies))
		var wg sync.WaitGroup
		for i, p := range s.proxies {
			wg.Go(func() { errs[i] = p.outage(ctx, down) })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	if s.pouch == nil {
		cmd := exec.CommandContext(ctx, "sh", "-c", s.restartCmd)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("CHAOS_COUCHDB_RESTART_CMD: %v: %s", err, bytes.TrimSpace(out))
		}
	} else {
		s.pouch.Lock()
		defer s.pouch.Unlock()
		sig := syscall.SIGKILL
		if term {
			sig = syscall.SIGTERM
		}
		if err := s.pouch.restart(ctx, sig, down); err != nil {
			return err
		}
	}
	return waitUntil(ctx, 60*time.Second, 100*time.Millisecond, "CouchDB back", func() bool {
		status, err := s.do(ctx, http.MethodGet, "/", nil, nil)
		return err == nil && status == http.StatusOK
	})
}

// do sends a request to path (escaped) with body as JSON; a 2xx answer is decoded into out
// when out is not nil. err is a transport failure or an undecodable answer; any status is
// returned as is.
func (s *couchServer) do(ctx context.Context, method, path string, body, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, err
		}
		rd = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, s.url+path, rd)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	resp, err := s.http.Do(req)
	if err != nil {
		return 0, errors.New(redact(err.Error(), s.url))
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, errors.New(redact(err.Error(), s.url))
	}
	if out != nil && resp.StatusCode < 300 {
		if err := json.Unmarshal(data, out); err != nil {
			return resp.StatusCode, fmt.Errorf("%s %s: decode answer: %w", method, path, err)
		}
	}
	return resp.StatusCode, nil
}

// redact removes the password of the URL base from text.
func redact(text, base string) string {
	u, err := url.Parse(base)
	if err != nil || u.User == nil {
		return text
	}
	if pw, ok := u.User.Password(); ok && pw != "" {
		text = strings.ReplaceAll(text, pw, "xxxxx")
		text = strings.ReplaceAll(text, url.QueryEscape(pw), "xxxxx")
	}
	return text
}

// installPouchDisk installs PouchDB Server from the pinned scripts/pouchdb/package-lock.json
// with `npm ci --ignore-scripts` into .chaos/tools/pouchdb-disk, whenever the tree there was
// not installed from the lock as it is now (a sha256 stamp, as scripts/lib.sh keeps). Unlike
// the test command's `npm ci --omit=optional` (in-memory only), this keeps the optional
// leveldown with its prebuilt binaries, so `-d DIR` (on disk) works; --ignore-scripts skips
// sqlite3's compile. The install goes to a temporary dir renamed into place, so an interrupted
// one leaves nothing half-done. It returns the install dir.
func installPouchDisk(ctx context.Context, r *run) (string, error) {
	src := filepath.Join(r.cfg.Root, "scripts", "pouchdb")
	lock, err := os.ReadFile(filepath.Join(src, "package-lock.json"))
	if err != nil {
		return "", err
	}
	want := fmt.Sprintf("%x", sha256.Sum256(lock))
	base := filepath.Join(r.cfg.Root, ".chaos", "tools")
	dir := filepath.Join(base, "pouchdb-disk")
	stamp := func(d string) string { return filepath.Join(d, "node_modules", ".spiegel-lock.sha256") }
	if have, err := os.ReadFile(stamp(dir)); err == nil && strings.TrimSpace(string(have)) == want {
		return dir, nil
	}
	r.logf("installing PouchDB Server for on-disk use (npm ci --ignore-scripts, pinned by scripts/pouchdb/package-lock.json)")
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(base, "install-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	for _, f := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(tmp, f), b, 0o644); err != nil {
			return "", err
		}
	}
	cmd := exec.CommandContext(ctx, "npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error")
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("npm ci --ignore-scripts: %v: %s", err, bytes.TrimSpace(out))
	}
	if err := os.WriteFile(stamp(tmp), []byte(want+"\n"), 0o644); err != nil {
		return "", err
	}
	_ = os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		if have, err2 := os.ReadFile(stamp(dir)); err2 == nil && strings.TrimSpace(string(have)) == want {
			return dir, nil // another run installed it meanwhile
		}
		return "", err
	}
	return dir, nil
}
