package natstest

import (
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRestartKeepsStreams(t *testing.T) {
	srv := Start(t)
	_, js := srv.Connect(t)
	_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	url := srv.URL()
	srv.Restart(t)
	assert.Equal(t, url, srv.URL())
	_, js2 := srv.Connect(t)
	_, err = js2.Stream(t.Context(), "S")
	assert.NoError(t, err)
}
