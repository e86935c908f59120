package chaos

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A cluster's node list gives every node the first URL's credentials (the run's own requests
// go to the last node), and a URL that does not parse is named by its place, never shown.
func TestNodeURLs(t *testing.T) {
	t.Parallel()
	nodes, err := nodeURLs("http://admin:pa,ss@127.0.0.1:15984/, http://127.0.0.1:25984,http://u:p@127.0.0.1:35984")
	require.NoError(t, err)
	assert.Equal(t, []string{"http://admin:pa,ss@127.0.0.1:15984", "http://admin:pa,ss@127.0.0.1:25984", "http://u:p@127.0.0.1:35984"}, nodes)

	one, err := nodeURLs("http://admin:pw@127.0.0.1:5984/")
	require.NoError(t, err)
	assert.Equal(t, []string{"http://admin:pw@127.0.0.1:5984"}, one)

	_, err = nodeURLs("http://admin:secret@127.0.0.1:5984,http://[::1")
	require.ErrorContains(t, err, "node 2")
	assert.NotContains(t, err.Error(), "secret")
}

// The node-kill fault needs the cluster's nodes listed.
func TestNodeCmdNeedsANodeList(t *testing.T) {
	t.Setenv("CHAOS_COUCHDB_URL", "http://admin:pw@127.0.0.1:5984")
	t.Setenv("CHAOS_COUCHDB_NODE_CMD", "cluster-ctl $CHAOS_NODE_ACTION $CHAOS_NODE")
	c := shortConfig(t.TempDir())
	require.ErrorContains(t, c.fromEnv(), "CHAOS_COUCHDB_NODE_CMD needs CHAOS_COUCHDB_URL to list the cluster's nodes")

	t.Setenv("CHAOS_COUCHDB_URL", "http://admin:pw@127.0.0.1:15984,http://127.0.0.1:25984,http://127.0.0.1:35984")
	c = shortConfig(t.TempDir())
	require.NoError(t, c.fromEnv())
	assert.Equal(t, 3, c.CouchNodes)
	assert.True(t, c.nodeKill())
}
