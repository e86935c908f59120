package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/freeport"
)

// cluster is three nats-server processes (bin/nats-server, built from the module's pinned
// nats-server) clustered over loopback routes, each with JetStream and its own store dir. A
// node keeps its ports and store across restarts.
type cluster struct {
	nodes []*natsNode
	nc    *nats.Conn // the run's own connection, to all three nodes
	js    jetstream.JetStream
}

// natsNode is one server of the cluster.
type natsNode struct {
	*proc
	name            string // server_name, as the servers report leaders
	client, monitor int    // ports
	store           string // JetStream store dir
}

// startCluster writes the three configs into dir and starts the nodes; it returns once every
// node answers /healthz with 200 and the run's connection has JetStream. With partitions
// (CHAOS_PARTITIONS=1) the nodes do not advertise their addresses to clients (no_advertise): a
// client knows only the URLs it was given, so a product process reaches every node through its
// own proxy (links.go).
func startCluster(ctx context.Context, r *run, dir string) (*cluster, error) {
	ports, err := freeport.Ports(9)
	if err != nil {
		return nil, err
	}
	var routes []string
	for i := range 3 {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", ports[6+i]))
	}
	noAdvertise := ""
	if r.cfg.Partitions {
		noAdvertise = ", no_advertise: true"
	}
	c := &cluster{}
	for i := range 3 {
		n := &natsNode{name: fmt.Sprintf("n%d", i+1), client: ports[i], monitor: ports[3+i]}
		n.store = filepath.Join(dir, n.name+"-store")
		conf := fmt.Sprintf(`server_name: %s
listen: 127.0.0.1:%d
http: 127.0.0.1:%d
jetstream { store_dir: %q, sync_interval: always }
cluster { name: chaos, listen: 127.0.0.1:%d, routes: [%s]%s }
`, n.name, n.client, n.monitor, n.store, ports[6+i], strings.Join(routes, ", "), noAdvertise)
		path := filepath.Join(dir, n.name+".conf")
		if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
			return nil, err
		}
		n.proc = &proc{name: "nats-" + n.name, path: filepath.Join(r.cfg.Root, "bin", "nats-server"), args: []string{"-c", path},
			env: os.Environ(), dir: dir, logPath: filepath.Join(r.logDir, "nats-"+n.name+".log"),
			ready: fmt.Sprintf("http://127.0.0.1:%d/healthz", n.monitor), run: r}
		c.nodes = append(c.nodes, n)
	}
	for _, n := range c.nodes {
		if err := n.start(); err != nil {
			return nil, err
		}
	}
	for _, n := range c.nodes {
		if err := n.waitReady(ctx, 30*time.Second); err != nil {
			return nil, err
		}
	}
	c.nc, err = nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		return nil, fmt.Errorf("connect to the cluster: %w", err)
	}
	if c.js, err = jetstream.New(c.nc); err != nil {
		return nil, err
	}
	err = waitUntil(ctx, 30*time.Second, 200*time.Millisecond, "a meta leader with every peer current", func() bool {
		return c.metaCurrent(ctx)
	})
	return c, err
}

// metaCurrent reports whether the meta group has a leader that sees the two other nodes as
// current peers.
func (c *cluster) metaCurrent(ctx context.Context) bool {
	leader, err := c.metaLeader(ctx)
	if err != nil {
		return false
	}
	n, err := c.node(leader)
	if err != nil {
		return false
	}
	var jsz struct {
		Meta struct {
			Leader   string `json:"leader"`
			Replicas []struct {
				Current bool `json:"current"`
			} `json:"replicas"`
		} `json:"meta_cluster"`
	}
	if err := getJSON(ctx, fmt.Sprintf("http://127.0.0.1:%d/jsz", n.monitor), &jsz); err != nil || jsz.Meta.Leader != leader {
		return false
	}
	current := 0
	for _, r := range jsz.Meta.Replicas {
		if r.Current {
			current++
		}
	}
	return current == len(c.nodes)-1
}

// URLs is the client URL list of all three nodes, as SPIEGEL_NATS_URL takes it.
func (c *cluster) URLs() string {
	var urls []string
	for _, n := range c.nodes {
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", n.client))
	}
	return strings.Join(urls, ",")
}

// node returns the node named name.
func (c *cluster) node(name string) (*natsNode, error) {
	for _, n := range c.nodes {
		if n.name == name {
			return n, nil
		}
	}
	return nil, fmt.Errorf("no node named %q", name)
}

// metaLeader returns the name of the JetStream meta leader, as the first running node's /jsz
// reports it (meta_cluster.leader).
func (c *cluster) metaLeader(ctx context.Context) (string, error) {
	for _, n := range c.nodes {
		if !n.running() {
			continue
		}
		var jsz struct {
			Meta struct {
				Leader string `json:"leader"`
			} `json:"meta_cluster"`
		}
		if err := getJSON(ctx, fmt.Sprintf("http://127.0.0.1:%d/jsz", n.monitor), &jsz); err == nil && jsz.Meta.Leader != "" {
			return jsz.Meta.Leader, nil
		}
	}
	return "", errors.New("no node names a meta leader")
}

// streamLeader returns the name of the node leading stream (the JetStream API's
// STREAM.INFO cluster.leader).
func (c *cluster) streamLeader(ctx context.Context, stream string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s, err := c.js.Stream(ctx, stream)
	if err != nil {
		return "", err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return "", err
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return "", fmt.Errorf("stream %s has no leader", stream)
	}
	return info.Cluster.Leader, nil
}

// killAndRestart SIGKILLs the node, waits down, starts it again and waits for its /healthz
// (JetStream current again). It returns an error only if the node did not come back.
func (c *cluster) killAndRestart(ctx context.Context, n *natsNode, down time.Duration) error {
	return c.killAndRestartWatching(ctx, n, down, func() {}, nil)
}

// killAndRestartWatching is killAndRestart that calls mark right before the SIGKILL and, while
// the node is down, whileDown (given the down time, which it should not outlast); the node
// starts again once both the down time and whileDown are over.
func (c *cluster) killAndRestartWatching(ctx context.Context, n *natsNode, down time.Duration, mark func(), whileDown func(time.Duration)) error {
	n.Lock()
	defer n.Unlock()
	mark()
	n.stop(syscall.SIGKILL, 10*time.Second)
	until := time.Now().Add(down)
	if whileDown != nil {
		whileDown(down)
	}
	if err := sleepCtx(ctx, time.Until(until)); err != nil {
		return err
	}
	if err := n.start(); err != nil {
		return err
	}
	return n.waitReady(ctx, 60*time.Second)
}

// newConsumerLeader waits, at most within, until consumer of stream has a leader other than
// old, and returns it (empty if none came).
func (c *cluster) newConsumerLeader(ctx context.Context, stream, consumer, old string, within time.Duration) string {
	var leader string
	_ = waitUntil(ctx, within, 100*time.Millisecond, "a new consumer leader", func() bool {
		l, err := c.consumerLeader(ctx, stream, consumer)
		if err == nil && l != old {
			leader = l
		}
		return leader != ""
	})
	return leader
}

// storeLoss plays a power failure with lazy fsync on nodes (one, or every node at once): it
// copies each node's store dir as it is on disk now, calls mark, lets the cluster run on for
// lag (acknowledging writes the copies do not hold), SIGKILLs the nodes together, replaces
// each store with its copy, waits down and starts them again. It returns once every node
// answers /healthz (JetStream current), or with an error if one did not come back.
//
// The copy is taken while the node runs, file by file: a file being written may be copied
// half-written, as a crash leaves it.
func (c *cluster) storeLoss(ctx context.Context, nodes []*natsNode, lag, down time.Duration, mark func()) error {
	for _, n := range nodes {
		n.Lock()
		defer n.Unlock()
	}
	for _, n := range nodes {
		_ = os.RemoveAll(n.store + ".copy")
		if err := copyTree(n.store, n.store+".copy"); err != nil {
			return fmt.Errorf("copy the store of nats-%s: %w", n.name, err)
		}
	}
	mark()
	werr := sleepCtx(ctx, lag)
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Go(func() { n.stop(syscall.SIGKILL, 10*time.Second) })
	}
	wg.Wait()
	for _, n := range nodes {
		if err := os.RemoveAll(n.store); err != nil {
			return fmt.Errorf("remove the store of nats-%s: %w", n.name, err)
		}
		if err := os.Rename(n.store+".copy", n.store); err != nil {
			return fmt.Errorf("put back the copy of the store of nats-%s: %w", n.name, err)
		}
	}
	if werr == nil {
		werr = sleepCtx(ctx, down)
	}
	for _, n := range nodes {
		if err := n.start(); err != nil {
			return err
		}
	}
	for _, n := range nodes {
		if err := n.waitReady(ctx, 90*time.Second); err != nil {
			return err
		}
	}
	return werr
}

// copyTree copies the files of dir src into dst (created), skipping files that vanish while it
// runs (a store compacting).
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, 0o644)
	})
}

// close closes the run's connection.
func (c *cluster) close() {
	if c != nil && c.nc != nil {
		c.nc.Close()
	}
}

// getJSON decodes the answer of GET url into out.
func getJSON(ctx context.Context, url string, out any) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// consumerLeader returns the name of the node leading consumer of stream (the JetStream API's
// CONSUMER.INFO cluster.leader).
func (c *cluster) consumerLeader(ctx context.Context, stream, consumer string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s, err := c.js.Stream(ctx, stream)
	if err != nil {
		return "", err
	}
	cons, err := s.Consumer(ctx, consumer)
	if err != nil {
		return "", err
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return "", err
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return "", fmt.Errorf("consumer %s of %s has no leader", consumer, stream)
	}
	return info.Cluster.Leader, nil
}

// stepDownConsumer asks the leader of consumer of stream to step down
// ($JS.API.CONSUMER.LEADER.STEPDOWN.<stream>.<consumer>), as an operator or a rolling upgrade
// does, and waits until the consumer has a leader again. It calls mark once it knows the leader
// and is about to send the request. A request the servers refuse or do not answer (an election
// under way) is sent again for up to 20s.
func (c *cluster) stepDownConsumer(ctx context.Context, stream, consumer string, mark func()) (what, skipped string, err error) {
	what = fmt.Sprintf("leader of consumer %s of %s asked to step down", consumer, stream)
	before, after, err := c.stepDown(ctx, stream, consumer, mark)
	if err == nil {
		what = fmt.Sprintf("leader of consumer %s of %s stepped down: nats-%s → nats-%s", consumer, stream, before, after)
	}
	return what, "", err
}

// stepDown is stepDownConsumer, returning the leader before (empty if none was found) and the
// one after (empty if none came).
func (c *cluster) stepDown(ctx context.Context, stream, consumer string, mark func()) (before, after string, err error) {
	if err := waitUntil(ctx, 20*time.Second, 200*time.Millisecond, "a consumer leader to step down", func() bool {
		var lerr error
		before, lerr = c.consumerLeader(ctx, stream, consumer)
		return lerr == nil
	}); err != nil {
		return "", "", err
	}
	mark()
	subject := fmt.Sprintf("$JS.API.CONSUMER.LEADER.STEPDOWN.%s.%s", stream, consumer)
	var answer struct {
		Success bool `json:"success"`
		Error   *struct {
			Code        int    `json:"code"`
			Description string `json:"description"`
		} `json:"error"`
	}
	var last error
	if err := waitUntil(ctx, 20*time.Second, 500*time.Millisecond, "a stepdown the servers accept", func() bool {
		rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		msg, err := c.nc.RequestWithContext(rctx, subject, nil)
		if err == nil {
			answer.Success, answer.Error = false, nil
			err = json.Unmarshal(msg.Data, &answer)
		}
		switch {
		case err != nil:
			last = err
		case answer.Error != nil:
			last = fmt.Errorf("%d %s", answer.Error.Code, answer.Error.Description)
		case !answer.Success:
			last = fmt.Errorf("answer %q", msg.Data)
		default:
			return true
		}
		return false
	}); err != nil {
		return before, "", fmt.Errorf("%w (last answer: %v)", err, last)
	}
	err = waitUntil(ctx, 30*time.Second, 200*time.Millisecond, "the consumer's new leader", func() bool {
		var lerr error
		after, lerr = c.consumerLeader(ctx, stream, consumer)
		return lerr == nil
	})
	return before, after, err
}
