package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// CouchDB 3's defaults of its [global_changes] settings, in milliseconds. _db_updates is served
// from the _global_changes db, which each node writes every max_write_delay (its listener hands
// the events over every max_event_delay): that is the floor of the latency of every job the
// feed starts. CouchDB applies a new max_write_delay at once; max_event_delay only when the node
// starts (3.3 and 3.5 send the change to a listener that is not registered under the name the
// config handler casts to), so a value set through _config shows before it is in effect.
const (
	defaultMaxWriteDelayMS = 500
	defaultMaxEventDelayMS = 25
	// maxDelayNodes bounds the nodes whose settings status reads (one request each).
	maxDelayNodes = 32
	// latencyDocs names the operating docs' section on the feed's floor.
	latencyDocs = `deployments/README.md, "The feed's floor: CouchDB's max_write_delay"`
)

// globalChanges is the CouchDB server's [global_changes] max_write_delay and max_event_delay,
// as `producer status` shows them (JSON: couchdb_global_changes). Spiegel only reads them.
// Known is false when they cannot be read (PouchDB Server, no server admin, an old CouchDB):
// Reason says why; that never fails the command.
type globalChanges struct {
	Known  bool   `json:"known"`
	Reason string `json:"reason,omitempty"`
	// MaxWriteDelayMS and MaxEventDelayMS are the largest of the nodes' (the floor of a cluster).
	MaxWriteDelayMS int `json:"max_write_delay_ms,omitempty"`
	MaxEventDelayMS int `json:"max_event_delay_ms,omitempty"`
	// Default is true when max_write_delay is CouchDB's default (unset or 500) on some node,
	// EventDefault when max_event_delay is (unset or 25).
	Default      bool                `json:"max_write_delay_default"`
	EventDefault bool                `json:"max_event_delay_default"`
	Nodes        []globalChangesNode `json:"nodes,omitempty"`
	// Hint, with Default or EventDefault, says how to lower the floor (no credentials in it).
	Hint string `json:"hint,omitempty"`
}

// globalChangesNode is one node's settings: the values in effect and, when configured, the
// strings the configuration holds.
type globalChangesNode struct {
	Node                    string `json:"node"` // "_local" when the cluster's members are unknown
	MaxWriteDelayMS         int    `json:"max_write_delay_ms"`
	MaxEventDelayMS         int    `json:"max_event_delay_ms"`
	MaxWriteDelayConfigured string `json:"max_write_delay_configured,omitempty"` // "" when unset
	MaxEventDelayConfigured string `json:"max_event_delay_configured,omitempty"`
}

// readGlobalChanges reads the [global_changes] settings of every node of the cluster (GET
// /_membership, then /_node/{node}/_config/global_changes; /_node/_local/... when the members
// cannot be listed). It needs a server admin. It never fails: what cannot be read is reported
// as unknown with the reason, without credentials.
func readGlobalChanges(ctx context.Context, c *couch.Client) *globalChanges {
	unknown := func(reason string) *globalChanges {
		return &globalChanges{Reason: logging.RedactText(reason)}
	}
	if info, err := c.Server(ctx); err != nil {
		return unknown(err.Error())
	} else if info.PouchDB {
		return unknown("PouchDB Server has no [global_changes] settings (they are CouchDB's)")
	}
	nodes := []string{"_local"}
	var members struct {
		ClusterNodes []string `json:"cluster_nodes"`
	}
	if err := c.DoIdempotent(ctx, http.MethodGet, "/_membership", nil, nil, &members); err == nil && len(members.ClusterNodes) > 0 {
		nodes = members.ClusterNodes
		if len(nodes) > maxDelayNodes {
			nodes = nodes[:maxDelayNodes]
		}
	}
	gc := &globalChanges{Known: true}
	for _, node := range nodes {
		n, err := readNodeGlobalChanges(ctx, c, node)
		if err != nil {
			return unknown(explainConfigError(err))
		}
		gc.Nodes = append(gc.Nodes, n)
		gc.MaxWriteDelayMS = max(gc.MaxWriteDelayMS, n.MaxWriteDelayMS)
		gc.MaxEventDelayMS = max(gc.MaxEventDelayMS, n.MaxEventDelayMS)
		gc.Default = gc.Default || n.MaxWriteDelayMS == defaultMaxWriteDelayMS
		gc.EventDefault = gc.EventDefault || n.MaxEventDelayMS == defaultMaxEventDelayMS
	}
	if gc.Default || gc.EventDefault {
		gc.Hint = globalChangesHint(c, gc)
	}
	return gc
}

// readNodeGlobalChanges reads one node's [global_changes] section (values are JSON strings).
func readNodeGlobalChanges(ctx context.Context, c *couch.Client, node string) (globalChangesNode, error) {
	var section map[string]string
	path := "/_node/" + url.PathEscape(node) + "/_config/global_changes"
	if err := c.DoIdempotent(ctx, http.MethodGet, path, nil, nil, &section); err != nil {
		return globalChangesNode{}, err
	}
	n := globalChangesNode{Node: node, MaxWriteDelayConfigured: section["max_write_delay"],
		MaxEventDelayConfigured: section["max_event_delay"]}
	var err error
	if n.MaxWriteDelayMS, err = configMS(n.MaxWriteDelayConfigured, defaultMaxWriteDelayMS); err != nil {
		return n, fmt.Errorf("node %s: max_write_delay %w", node, err)
	}
	if n.MaxEventDelayMS, err = configMS(n.MaxEventDelayConfigured, defaultMaxEventDelayMS); err != nil {
		return n, fmt.Errorf("node %s: max_event_delay %w", node, err)
	}
	return n, nil
}

// configMS is a configured number of milliseconds, or def when unset.
func configMS(v string, def int) (int, error) {
	if v == "" {
		return def, nil
	}
	ms, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || ms < 0 {
		return 0, fmt.Errorf("%q is not a number of milliseconds", v)
	}
	return ms, nil
}

// explainConfigError words why the settings could not be read.
func explainConfigError(err error) string {
	var he *couch.HTTPError
	if errors.As(err, &he) {
		switch {
		case couch.Classify(he) == couch.Auth:
			return err.Error() + " (reading CouchDB's configuration needs a server admin)"
		case he.Status == http.StatusNotFound, he.Status == http.StatusBadRequest, he.Status == http.StatusMethodNotAllowed:
			return err.Error() + " (the server has no /_node/{node}/_config endpoint)"
		}
	}
	if errors.Is(err, io.EOF) {
		return "the server closed the connection: " + err.Error()
	}
	return err.Error()
}

// globalChangesHint says what the defaults cost and how to lower them on the nodes that have
// them, with the server's URL without credentials: max_write_delay through _config (applied at
// once), max_event_delay in each node's local.ini (applied when the node starts).
func globalChangesHint(c *couch.Client, gc *globalChanges) string {
	base := c.BaseURL()
	base.User, base.RawQuery, base.Fragment = nil, "", ""
	root := strings.TrimRight(base.String(), "/")
	var cmds, restart []string
	for _, n := range gc.Nodes {
		if n.MaxWriteDelayMS == defaultMaxWriteDelayMS {
			cmds = append(cmds, fmt.Sprintf(`curl -u ADMIN -X PUT %s/_node/%s/_config/global_changes/max_write_delay -d '"%d"'`,
				root, url.PathEscape(n.Node), recommendedMaxWriteDelayMS))
		}
		if n.MaxEventDelayMS == defaultMaxEventDelayMS {
			name := n.Node
			if name == "_local" { // the members could not be listed
				name = "the node"
			}
			restart = append(restart, name)
		}
	}
	var todo []string
	if len(cmds) > 0 {
		todo = append(todo, "set max_write_delay on every node (applied at once): "+strings.Join(cmds, "; "))
	}
	if len(restart) > 0 {
		todo = append(todo, fmt.Sprintf("put max_event_delay = %d in the [global_changes] section of the local.ini of %s "+
			"and restart the node (CouchDB reads it only when the node starts)", recommendedMaxEventDelayMS, strings.Join(restart, ", ")))
	}
	return fmt.Sprintf("CouchDB announces writes on _db_updates up to about %d ms late (max_write_delay %d ms + max_event_delay %d ms): "+
		"that is the floor of the latency of every job the feed starts. To lower it, %s (see %s)",
		gc.MaxWriteDelayMS+gc.MaxEventDelayMS, gc.MaxWriteDelayMS, gc.MaxEventDelayMS, strings.Join(todo, "; "), latencyDocs)
}

// recommendedMaxWriteDelayMS and recommendedMaxEventDelayMS are the settings the operating docs
// recommend.
const (
	recommendedMaxWriteDelayMS = 50
	recommendedMaxEventDelayMS = 10
)

// printGlobalChanges prints gc's lines (tab-separated for the status table).
func printGlobalChanges(w io.Writer, gc *globalChanges) {
	if !gc.Known {
		fmt.Fprintf(w, "couchdb _db_updates delay\tunknown: %s\n", gc.Reason)
		return
	}
	same := true
	for _, n := range gc.Nodes[1:] {
		same = same && n.MaxWriteDelayMS == gc.Nodes[0].MaxWriteDelayMS && n.MaxEventDelayMS == gc.Nodes[0].MaxEventDelayMS
	}
	if same {
		fmt.Fprintf(w, "couchdb _db_updates delay\t%s\n", nodeDelays(gc.Nodes[0], len(gc.Nodes)))
	} else {
		fmt.Fprintln(w, "couchdb _db_updates delay\tdiffers between nodes")
		for _, n := range gc.Nodes {
			fmt.Fprintf(w, "  %s\t%s\n", n.Node, nodeDelays(n, 1))
		}
	}
	if gc.Hint != "" {
		fmt.Fprintf(w, "  hint\t%s\n", gc.Hint)
	}
}

func nodeDelays(n globalChangesNode, nodes int) string {
	event := msSetting(n.MaxEventDelayMS, n.MaxEventDelayConfigured, defaultMaxEventDelayMS)
	if n.MaxEventDelayConfigured != "" {
		event += " (in effect once the node has restarted since it was set)"
	}
	s := fmt.Sprintf("[global_changes] max_write_delay %s, max_event_delay %s",
		msSetting(n.MaxWriteDelayMS, n.MaxWriteDelayConfigured, defaultMaxWriteDelayMS), event)
	if nodes > 1 {
		s += fmt.Sprintf(" (all %d nodes)", nodes)
	}
	return s
}

func msSetting(ms int, configured string, def int) string {
	switch {
	case configured == "":
		return fmt.Sprintf("%d ms (default, unset)", ms)
	case ms == def:
		return fmt.Sprintf("%d ms (default)", ms)
	}
	return fmt.Sprintf("%d ms", ms)
}
