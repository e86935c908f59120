package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// TestCatchUpBoundsEachRequest: a consumer create that NATS never answers (as during a leader
// election) ends the catch-up with an error well before the caller's deadline, and the next
// catch-up, once NATS answers again, reads every message. Before the bound, the unanswered
// request held the reader (and the convergence check waiting for its lock) until the caller's
// deadline. An unanswered read of the last message read is an error too, not a change of the
// stream: no reread from its start.
func TestCatchUpBoundsEachRequest(t *testing.T) {
	srv := natstest.Start(t)
	nc, js := srv.Connect(t)
	ctx := t.Context()
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "CHG", Subjects: []string{"chg.>"}})
	require.NoError(t, err)
	publish := func(seq int, id string) {
		body, err := json.Marshal(map[string]any{"db": "db1", "seq": fmt.Sprint(seq), "id": id, "changes": []map[string]string{{"rev": "1-x"}}})
		require.NoError(t, err)
		_, err = js.Publish(ctx, "chg.db1", body)
		require.NoError(t, err)
	}
	for i, id := range []string{"a", "b", "c"} {
		publish(i+1, id)
	}

	// The reader's JetStream API goes through a relay that forwards every request to the server,
	// except consumer creates while hang is set: those get no answer at all.
	var hang, hangGet atomic.Bool
	hang.Store(true)
	var dropped, droppedGets atomic.Int32
	_, err = nc.Subscribe("RELAY.API.>", func(m *nats.Msg) {
		rest := strings.TrimPrefix(m.Subject, "RELAY.API.")
		if hang.Load() && strings.HasPrefix(rest, "CONSUMER.CREATE.") {
			dropped.Add(1)
			return
		}
		if hangGet.Load() && (strings.HasPrefix(rest, "STREAM.MSG.GET.") || strings.HasPrefix(rest, "DIRECT.GET.")) {
			droppedGets.Add(1)
			return
		}
		_ = nc.PublishMsg(&nats.Msg{Subject: "$JS.API." + rest, Reply: m.Reply, Data: m.Data, Header: m.Header})
	})
	require.NoError(t, err)
	relayed, err := jetstream.NewWithAPIPrefix(nc, "RELAY.API")
	require.NoError(t, err)

	s := &streamReader{js: relayed, stream: "CHG", apiTimeout: 300 * time.Millisecond}
	caller, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	n, err := s.catchUp(caller)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NoError(t, caller.Err(), "the unanswered consumer create held the catch-up until the caller's deadline")
	require.Positive(t, dropped.Load(), "the relay dropped no consumer create: the test injected nothing")
	require.Zero(t, n)

	hang.Store(false)
	n, err = s.catchUp(caller)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	var ids []string
	for _, m := range s.all() {
		ids = append(ids, m.ID)
	}
	require.Equal(t, []string{"a", "b", "c"}, ids)

	publish(4, "d")
	hangGet.Store(true)
	_, err = s.catchUp(caller)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NoError(t, caller.Err())
	require.Positive(t, droppedGets.Load(), "the relay dropped no message read: the test injected nothing")
	hangGet.Store(false)
	n, err = s.catchUp(caller)
	require.NoError(t, err)
	require.Equal(t, 4, n)
	require.Zero(t, s.rereadCount(), "an unanswered read made the reader read the stream again from its start")
}
