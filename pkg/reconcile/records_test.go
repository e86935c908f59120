package reconcile

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

const (
	rep = events.GroupReplicate
	onc = events.GroupOnChange
)

// openRecords installs the done bucket on a fresh embedded NATS server.
func openRecords(t *testing.T) (*Records, jetstream.JetStream, natsjs.Topology) {
	t.Helper()
	_, js := natstest.Start(t).Connect(t)
	topo := natsjs.DefaultTopology("")
	require.NoError(t, natsjs.EnsureDoneBucket(t.Context(), js, topo))
	kv, err := natsjs.DoneBucket(t.Context(), js, topo)
	require.NoError(t, err)
	return New(js, kv), js, topo
}

func TestKeyRoundTrip(t *testing.T) {
	t.Parallel()
	for _, db := range []string{"a", "user_42", "a/b+c$d(e)", "with.dot", "ü", ""} {
		for _, g := range events.Groups {
			k := Key(g, db)
			assert.Regexp(t, `^[-_=a-zA-Z0-9]+\.[-_=a-zA-Z0-9]*$`, k, "a valid key with one dot")
			gg, dd, err := ParseKey(k)
			require.NoError(t, err, k)
			assert.Equal(t, g, gg)
			assert.Equal(t, db, dd)
		}
	}
	for _, bad := range []string{"", "replicate", "replicate.a.b", ".YQ", "replicate.!!"} {
		_, _, err := ParseKey(bad)
		assert.Error(t, err, bad)
	}
}

func FuzzRecordKey(f *testing.F) {
	f.Add("replicate", "user_1")
	f.Add("onchange", "a/b.c")
	f.Fuzz(func(t *testing.T, g, db string) {
		if g == "" || containsDot(g) {
			return
		}
		gg, dd, err := ParseKey(Key(events.Group(g), db))
		if err != nil || string(gg) != g || dd != db {
			t.Fatalf("Key(%q, %q) does not parse back: %q %q %v", g, db, gg, dd, err)
		}
	})
}

func containsDot(s string) bool {
	for i := range len(s) {
		if s[i] == '.' {
			return true
		}
	}
	return false
}

// Due names the groups whose record is missing or differs, compared as opaque strings.
func TestDue(t *testing.T) {
	t.Parallel()
	done := Done{Key(rep, "a"): "5-g1AAAA", Key(onc, "a"): "4-g1AAAA"}
	both := []events.Group{rep, onc}
	assert.Equal(t, []events.Group{onc}, done.Due("a", "5-g1AAAA", both))
	assert.Empty(t, done.Due("a", "5-g1AAAA", []events.Group{rep}))
	assert.Equal(t, both, done.Due("b", "5-g1AAAA", both), "no record: due")
	assert.Equal(t, both, done.Due("a", "6-g1AAAA", both))
	assert.Equal(t, both, Done{}.Due("a", "1", both))
}

// Read returns every record as last put; DropDB removes a deleted db's records of every group
// and nothing else; a bucket that is gone is ErrNoBucket.
func TestReadAndDropDB(t *testing.T) {
	t.Parallel()
	r, js, topo := openRecords(t)
	ctx := t.Context()
	empty, err := r.Read(ctx)
	require.NoError(t, err)
	assert.Empty(t, empty)

	require.NoError(t, r.Put(ctx, rep, "a/b", "1"))
	require.NoError(t, r.Put(ctx, rep, "a/b", "2"))
	require.NoError(t, r.Put(ctx, onc, "a/b", "2"))
	require.NoError(t, r.Put(ctx, rep, "c", "7"))
	done, err := r.Read(ctx)
	require.NoError(t, err)
	assert.Equal(t, Done{Key(rep, "a/b"): "2", Key(onc, "a/b"): "2", Key(rep, "c"): "7"}, done)

	require.NoError(t, r.DropDB(ctx, "a/b"))
	done, err = r.Read(ctx)
	require.NoError(t, err)
	assert.Equal(t, Done{Key(rep, "c"): "7"}, done)

	require.NoError(t, js.DeleteKeyValue(ctx, topo.Subjects.DoneBucket()))
	_, err = r.Read(ctx)
	assert.ErrorIs(t, err, ErrNoBucket)
	// Created again (as the producer's sweep does), the same handle works on.
	require.NoError(t, natsjs.EnsureDoneBucket(ctx, js, topo))
	require.NoError(t, r.Put(ctx, rep, "c", "8"))
	done, err = r.Read(ctx)
	require.NoError(t, err)
	assert.Equal(t, Done{Key(rep, "c"): "8"}, done)
}

// infos answers DBInfo from a map; a missing db is couch.ErrNotFound, err fails every read.
type infos struct {
	seqs  map[string]string
	err   error
	reads int
}

func (f *infos) DBInfo(_ context.Context, db string) (couch.DBInfo, error) {
	f.reads++
	if f.err != nil {
		return couch.DBInfo{}, f.err
	}
	seq, ok := f.seqs[db]
	if !ok {
		return couch.DBInfo{}, couch.ErrNotFound
	}
	return couch.DBInfo{Name: db, UpdateSeq: seq}, nil
}

// The recorder reads the db's update_seq before the handler runs, hands it to the handler, and
// records it only after a success.
func TestRecorderWrap(t *testing.T) {
	t.Parallel()
	r, _, _ := openRecords(t)
	log := logrus.New()
	for _, c := range []struct {
		name     string
		db       string
		readErr  error
		result   error
		recorded bool
	}{
		{"success", "ok", nil, nil, true},
		{"transient failure", "failed", nil, errors.New("boom"), false},
		{"postponed", "postponed", nil, worker.RetryAfter(1, nil), false},
		{"missing db", "missing", nil, nil, false},
		{"db info not read", "unread", errors.New("couch down"), nil, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dbs := &infos{seqs: map[string]string{c.db: "3-" + c.db}, err: c.readErr}
			if c.db == "missing" {
				dbs.seqs = nil
			}
			var seen couch.DBInfo
			var seenOK bool
			var seenErr error
			h := NewRecorder(dbs, r, log).Wrap(func(ctx context.Context, job *worker.Job) error {
				seen, seenOK, seenErr = StartInfo(ctx)
				return c.result
			})
			err := h(t.Context(), &worker.Job{Group: rep, DB: c.db})
			assert.Equal(t, c.result, err, "the handler's result is passed on")
			assert.Equal(t, 1, dbs.reads, "one db info read per job")
			assert.True(t, seenOK, "the handler sees the info")
			if c.readErr == nil && c.db != "missing" {
				assert.Equal(t, "3-"+c.db, seen.UpdateSeq)
				assert.NoError(t, seenErr)
			} else {
				assert.Error(t, seenErr)
			}
			done, rerr := r.Read(t.Context())
			require.NoError(t, rerr)
			seq, ok := done[Key(rep, c.db)]
			assert.Equal(t, c.recorded, ok)
			if c.recorded {
				assert.Equal(t, "3-"+c.db, seq)
			}
		})
	}
	_, ok, _ := StartInfo(t.Context())
	assert.False(t, ok, "no info outside Wrap")
}
