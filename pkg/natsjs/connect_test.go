package natsjs

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// While a connection is down, a consumer's connection (NoReconnectBuffer) refuses publishes at
// once instead of keeping them to send after the reconnect, when the job they belonged to may
// have gone to another instance. The default connection buffers them.
func TestNoReconnectBufferRefusesPublishesWhileDown(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	log := logrus.New()
	log.SetLevel(logrus.PanicLevel)
	for _, tc := range []struct {
		name     string
		noBuffer bool
	}{{"consumer", true}, {"default", false}} {
		t.Run(tc.name, func(t *testing.T) {
			proxy := srv.NewProxy(t)
			nc, err := Connect(t.Context(), Options{URLs: proxy.URL(), Name: tc.name, NoReconnectBuffer: tc.noBuffer}, log)
			require.NoError(t, err)
			t.Cleanup(nc.Close)
			require.NoError(t, nc.Publish("spiegel.test", []byte("up")))
			require.NoError(t, nc.Flush())

			proxy.Freeze() // reconnect attempts hang until the thaw
			proxy.Cut()
			require.Eventually(t, func() bool { return nc.Status() == nats.RECONNECTING }, 10*time.Second, 10*time.Millisecond)
			err = nc.Publish("spiegel.test", []byte("while down"))
			if tc.noBuffer {
				assert.True(t, errors.Is(err, nats.ErrReconnectBufExceeded), "got %v", err)
			} else {
				assert.NoError(t, err, "buffered for after the reconnect")
			}
		})
	}
}
