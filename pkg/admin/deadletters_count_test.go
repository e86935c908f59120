package admin

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// deadLettersByRule counts every record, even when the server's pending count says 0 before
// the last one (as a clustered JetStream under load can).
func TestDeadLettersByRuleCountsEveryRecord(t *testing.T) {
	t.Parallel()
	proxy := natstest.Start(t).NewProxy(t)
	proxy.RewriteReplies(natstest.ZeroPendingAt("DL", 3))
	_, js := proxy.Connect(t)
	_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "DL", Subjects: []string{"dl.>"}})
	require.NoError(t, err)
	for i := range 10 {
		b, err := json.Marshal(worker.DeadLetter{Rule: fmt.Sprintf("r%d", i%2)})
		require.NoError(t, err)
		_, err = js.Publish(t.Context(), "dl.x", b)
		require.NoError(t, err)
	}
	got, err := deadLettersByRule(t.Context(), js, "DL")
	require.NoError(t, err)
	assert.Equal(t, map[string]int{"r0": 5, "r1": 5}, got)
}
