package natsjs

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// throughEarlyZero connects to a new server through a proxy whose third message of every
// delivery of stream KV_B says 0 pending, and creates bucket B with history.
func throughEarlyZero(t *testing.T, history uint8) (jetstream.JetStream, jetstream.KeyValue, jetstream.Stream) {
	t.Helper()
	proxy := natstest.Start(t).NewProxy(t)
	proxy.RewriteReplies(natstest.ZeroPendingAt("KV_B", 3))
	_, js := proxy.Connect(t)
	kv, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: "B", History: history})
	require.NoError(t, err)
	s, err := js.Stream(t.Context(), "KV_B")
	require.NoError(t, err)
	return js, kv, s
}

// LastPerSubject returns the latest message of every subject, deletes included, when the
// server's pending count says 0 early — where nats.go's key listing stops (the test checks that
// it does, so that it proves something). With a filter, only that subject pattern; in a bucket
// that keeps history, the latest message of each key.
func TestLastPerSubjectReadsEverySubject(t *testing.T) {
	t.Parallel()
	_, kv, s := throughEarlyZero(t, 5)
	ctx := t.Context()
	want := map[string]string{} // subject -> latest value ("" deleted)
	for i := range 20 {
		for _, db := range []string{"a", "b"} {
			key := fmt.Sprintf("%s.k%02d", db, i)
			for rev := range 3 {
				_, err := kv.PutString(ctx, key, fmt.Sprintf("%d", rev))
				require.NoError(t, err)
			}
			want["$KV.B."+key] = "2"
			if i%4 == 0 {
				require.NoError(t, kv.Delete(ctx, key))
				want["$KV.B."+key] = ""
			}
		}
	}
	lister, err := kv.ListKeysFiltered(ctx, "a.*")
	require.NoError(t, err)
	listed := 0
	for range lister.Keys() {
		listed++
	}
	require.Less(t, listed, 15, "nats.go's listing stops at the early 0")

	got, err := LastPerSubject(ctx, s, "", false, 5*time.Second)
	require.NoError(t, err)
	values := map[string]string{}
	for subject, m := range got {
		if KVDeleted(m.Header) {
			values[subject] = ""
			continue
		}
		values[subject] = string(m.Data)
	}
	assert.Equal(t, want, values)

	got, err = LastPerSubject(ctx, s, "$KV.B.a.*", true, 5*time.Second)
	require.NoError(t, err)
	assert.Len(t, got, 20)
	for subject, m := range got {
		assert.Equal(t, want[subject] == "", KVDeleted(m.Header), subject)
		assert.Empty(t, m.Data, "headers only")
	}

	got, err = LastPerSubject(ctx, s, "$KV.B.none.*", true, 5*time.Second)
	require.NoError(t, err)
	assert.Empty(t, got)
}

// More subjects than one read asks for: the reads after the first start where the previous
// one ended, and every subject is read once.
func TestLastPerSubjectAcrossReads(t *testing.T) {
	t.Parallel()
	js, _, s := throughEarlyZero(t, 1)
	n := lastBatch + 500
	for i := range n {
		_, err := js.PublishAsync(fmt.Sprintf("$KV.B.k%d", i), []byte("v"))
		require.NoError(t, err)
		if i%1000 == 999 {
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(time.Minute):
				t.Fatal("not stored")
			}
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		t.Fatal("not stored")
	}
	got, err := LastPerSubject(t.Context(), s, "", true, 5*time.Second)
	require.NoError(t, err)
	assert.Len(t, got, n)
}

// Subjects purged after LastPerSubject counted them are not waited for: once nothing comes for
// idle, it finds the stream holds no subject it did not read.
func TestLastPerSubjectAfterAPurge(t *testing.T) {
	_, kv, s := throughEarlyZero(t, 1)
	for i := range 10 {
		_, err := kv.PutString(t.Context(), fmt.Sprintf("k%d", i), "v")
		require.NoError(t, err)
	}
	testHookCounted = func() { require.NoError(t, s.Purge(t.Context(), jetstream.WithPurgeSubject("$KV.B.k7"))) }
	t.Cleanup(func() { testHookCounted = nil })
	got, err := LastPerSubject(t.Context(), s, "", false, 500*time.Millisecond)
	require.NoError(t, err)
	assert.Len(t, got, 9)
	assert.NotContains(t, got, "$KV.B.k7")
}

// With a filter, a key rewritten after the subjects were named is waited for, even when a key
// first written meanwhile came before it: counting instead of naming stopped at as many keys
// and left the rewritten one out (a mirror's drop would have kept it).
func TestLastPerSubjectWaitsForARewrittenSubject(t *testing.T) {
	_, kv, s := throughEarlyZero(t, 1)
	for i := range 20 {
		_, err := kv.PutString(t.Context(), fmt.Sprintf("a.k%02d", i), "v1")
		require.NoError(t, err)
	}
	testHookCounted = func() {
		_, err := kv.PutString(t.Context(), "a.new", "v1")
		require.NoError(t, err)
		_, err = kv.PutString(t.Context(), "a.k00", "v2")
		require.NoError(t, err)
	}
	t.Cleanup(func() { testHookCounted = nil })
	got, err := LastPerSubject(t.Context(), s, "$KV.B.a.*", false, 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, got, "$KV.B.a.k00")
	assert.Equal(t, "v2", string(got["$KV.B.a.k00"].Data))
	assert.Len(t, got, 21)
}
