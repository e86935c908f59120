package admin

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestSeqAfter(t *testing.T) {
	assert.True(t, seqAfter("12", "3"), "PouchDB seqs are numbers")
	assert.False(t, seqAfter("3", "12"))
	assert.False(t, seqAfter("7", "7"))
	assert.True(t, seqAfter("12-g1AAAAB5eJzLYWBgYMpgTmHgz8tPSTV0MDQy", "9-g1AAAACbeJzLYWBgYMpgTmHgz8tPST"), "CouchDB's lead with their sum")
	assert.False(t, seqAfter("9-g1AAAACbeJzLYWBgYMpgTmHgz8tPST", "12-g1AAAAB5eJzLYWBgYMpgTmHgz8tPSTV0MDQy"))
	assert.True(t, seqAfter("now", "3"), "without a number: after (move back rather than skip)")
	assert.True(t, seqAfter("3", "opaque"))
}
