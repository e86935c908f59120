package main

import (
	"encoding/base64"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/healthtest"
)

// Deleting a db an on_change rule matches drops its cached checkpoints, of every rule, and
// leaves nothing in the bucket; deleting a db no on_change rule matches sends nothing to NATS.
func TestDeletedDBDropsCachedCheckpoints(t *testing.T) {
	e := newEnv(t)
	e.cfg.HTTPAddr = healthtest.FreeAddr(t)
	watched, unwatched, kept := e.Prefix+"watched", e.Prefix+"unwatched", e.Prefix+"kept"
	for _, db := range []string{watched, unwatched, kept} {
		e.Couch.CreateDB(t, db)
	}
	e.putRule(t, "hook", map[string]any{"type": "on_change", "db_name": "^" + e.Prefix + "(watched|kept)$", "url": "http://127.0.0.1:1/"})
	kv, err := e.JS.KeyValue(t.Context(), "SPIEGEL_ONCHANGE")
	require.NoError(t, err)
	key := func(rule, db string) string {
		enc := base64.RawURLEncoding
		return enc.EncodeToString([]byte(rule)) + "." + enc.EncodeToString([]byte(db))
	}
	for _, k := range []string{key("hook", watched), key("old", watched), key("hook", kept), key("old", unwatched)} {
		_, err := kv.Put(t.Context(), k, []byte(`{"last_seq":"1"}`))
		require.NoError(t, err)
	}
	e.startProducer(t)
	e.waitJob(t, onc, watched, 20*time.Second)
	for _, db := range []string{watched, unwatched} {
		require.NoError(t, e.Couch.Client.DestroyDB(t.Context(), db))
	}
	require.Eventually(t, func() bool {
		return metric(t, e.cfg.HTTPAddr, "spiegel_deleted_db_checkpoints_dropped_total") == 1
	}, 20*time.Second, 20*time.Millisecond, "the deleted db's checkpoints were not dropped")
	for _, k := range []string{key("hook", watched), key("old", watched)} {
		_, err := kv.Get(t.Context(), k)
		assert.ErrorIs(t, err, jetstream.ErrKeyNotFound)
	}
	s, err := e.JS.Stream(t.Context(), "KV_SPIEGEL_ONCHANGE")
	require.NoError(t, err)
	info, err := s.Info(t.Context())
	require.NoError(t, err)
	assert.Equal(t, uint64(2), info.State.Msgs, "the kept entries only: no marker left behind")
	_, err = kv.Get(t.Context(), key("old", unwatched))
	assert.NoError(t, err, "a db no on_change rule matches is not looked at")
}
