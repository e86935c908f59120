package natstest

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Between Stop and StartAgain clients see NATS down; afterwards they reconnect to the same URL
// and find their streams.
func TestStopAndStartAgain(t *testing.T) {
	srv := Start(t)
	nc, js := srv.Connect(t)
	_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	url := srv.URL()

	srv.Stop()
	srv.Stop() // a second Stop does nothing
	require.Eventually(t, func() bool { return !nc.IsConnected() }, 5*time.Second, 10*time.Millisecond, "client still connected")

	srv.StartAgain(t)
	assert.Equal(t, url, srv.URL())
	require.Eventually(t, nc.IsConnected, 10*time.Second, 10*time.Millisecond, "client did not reconnect")
	_, err = js.Stream(t.Context(), "S")
	assert.NoError(t, err)
}
