package reconcile

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
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
	assert.Equal(t, []events.Group{onc}, done.Due("a", "5-g1AAAA", both, nil))
	assert.Empty(t, done.Due("a", "5-g1AAAA", []events.Group{rep}, nil))
	assert.Equal(t, both, done.Due("b", "5-g1AAAA", both, nil), "no record: due")
	assert.Equal(t, both, done.Due("a", "6-g1AAAA", both, nil))
	assert.Equal(t, both, Done{}.Due("a", "1", both, nil))
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

// Read returns every record when the server's pending count says 0 early, as a clustered
// JetStream under load can: a KV watch would end its current values there, and the sweep would
// enqueue the dbs of the records it left out for nothing.
func TestReadDoesNotStopAtAnEarlyZeroPending(t *testing.T) {
	t.Parallel()
	topo := natsjs.DefaultTopology("")
	proxy := natstest.Start(t).NewProxy(t)
	proxy.RewriteReplies(natstest.ZeroPendingAt("KV_"+topo.Subjects.DoneBucket(), 3))
	_, js := proxy.Connect(t)
	require.NoError(t, natsjs.EnsureDoneBucket(t.Context(), js, topo))
	kv, err := natsjs.DoneBucket(t.Context(), js, topo)
	require.NoError(t, err)
	r := New(js, kv)
	want := Done{}
	for i := range 30 {
		db := fmt.Sprintf("db%02d", i)
		require.NoError(t, r.Put(t.Context(), rep, db, "1"))
		want[Key(rep, db)] = "1"
	}
	done, err := r.Read(t.Context())
	require.NoError(t, err)
	assert.Equal(t, want, done)
}

// infos answers DBInfo from a map; a missing db is couch.ErrNotFound, err fails every read.
// ChangedSince says true for the seqs in behind, and fails with askErr.
type infos struct {
	seqs   map[string]string
	err    error
	reads  int
	behind []string
	askErr error
	asked  []string
}

func (f *infos) ChangedSince(_ context.Context, _, since string) (bool, error) {
	f.asked = append(f.asked, since)
	return slices.Contains(f.behind, since), f.askErr
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

// The recorder records, after a success only, a position every part the handler vouched for
// has passed: without a request of its own when they vouched one seq; else CouchDB is asked
// about each seq. A settled job records the db's update_seq read after it.
func TestRecorderWrap(t *testing.T) {
	t.Parallel()
	r, _, _ := openRecords(t)
	log := logrus.New()
	for _, c := range []struct {
		name    string
		db      string
		vouched []string
		behind  []string // the vouched seqs CouchDB has changes after
		askErr  error
		settled bool
		result  error
		want    string // "" = nothing recorded
		reads   int
		asked   int
	}{
		{name: "success", db: "ok", vouched: []string{"3-ok"}, want: "3-ok"},
		{name: "two rules at one seq", db: "same", vouched: []string{"3-a", "3-a"}, want: "3-a"},
		{name: "two rules at two seqs, both current", db: "current", vouched: []string{"12", "7"}, want: "12", asked: 2},
		{name: "two rules, one behind: its seq", db: "behind", vouched: []string{"12", "7"}, behind: []string{"7"}, want: "7", asked: 2},
		{name: "two rules, both behind: cannot tell", db: "both_behind", vouched: []string{"3-a", "3-b"}, behind: []string{"3-a", "3-b"}, asked: 2},
		{name: "a question fails: cannot tell", db: "no_answer", vouched: []string{"3-a", "3-b"}, askErr: errors.New("boom"), asked: 1},
		{name: "transient failure", db: "failed", vouched: []string{"3-failed"}, result: errors.New("boom")},
		{name: "postponed", db: "postponed", vouched: []string{"3-postponed"}, result: worker.RetryAfter(1, nil)},
		{name: "nothing vouched", db: "silent"},
		{name: "settled", db: "settled", settled: true, want: "3-settled", reads: 1},
		{name: "settled, but a rule vouched", db: "both", vouched: []string{"2-both"}, settled: true, want: "2-both"},
		{name: "settled, db missing", db: "missing", settled: true, reads: 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			dbs := &infos{seqs: map[string]string{c.db: "3-" + c.db}, behind: c.behind, askErr: c.askErr}
			if c.db == "missing" {
				dbs.seqs = nil
			}
			h := NewRecorder(dbs, r, log).Wrap(func(ctx context.Context, job *worker.Job) error {
				for _, s := range c.vouched {
					Vouch(ctx, s)
				}
				if c.settled {
					Settled(ctx)
				}
				return c.result
			})
			err := h(t.Context(), &worker.Job{Group: rep, DB: c.db})
			assert.Equal(t, c.result, err, "the handler's result is passed on")
			assert.Equal(t, c.reads, dbs.reads, "db info reads")
			assert.Len(t, dbs.asked, c.asked, "questions to CouchDB: %v", dbs.asked)
			done, rerr := r.Read(t.Context())
			require.NoError(t, rerr)
			seq, ok := done[Key(rep, c.db)]
			assert.Equal(t, c.want != "", ok, "recorded")
			assert.Equal(t, c.want, seq)
		})
	}
	Vouch(t.Context(), "1") // outside Wrap: nothing to do, no panic
	Settled(t.Context())
}

// A record covers the db's update_seq by itself only when it is the same string: seqs are
// opaque (the sweep asks CouchDB about the others).
func TestDueComparesStrings(t *testing.T) {
	t.Parallel()
	done := Done{Key(rep, "a"): "9", Key(rep, "b"): "4", Key(rep, "c"): "3-x"}
	assert.Empty(t, done.Due("a", "9", []events.Group{rep}, nil))
	assert.Equal(t, []events.Group{rep}, done.Due("a", "8", []events.Group{rep}, nil), "another string: not known done")
	assert.Equal(t, []events.Group{rep}, done.Due("b", "5", []events.Group{rep}, nil))
	assert.Equal(t, []events.Group{rep}, done.Due("c", "3-y", []events.Group{rep}, nil))
	assert.Equal(t, []events.Group{rep}, done.Due("d", "1", []events.Group{rep}, nil), "no record")
	assert.False(t, Covered("", ""), "no record covers nothing")
}

// A write that lands while the job runs, after its read of the feed, leaves the db due: the
// record is where the job's read ended, not where the db is when the job ends. On CouchDB 3 the
// record (a _changes last_seq) and the update_seq the sweep reads are different strings for the
// same state: the sweep still finds the db done when nothing landed.
func TestRecordIsWhereTheReadEnded(t *testing.T) {
	t.Parallel()
	cs := couchtest.Get(t)
	r, _, _ := openRecords(t)
	cc, err := couch.New(couch.Config{URL: cs.URL}, nil)
	require.NoError(t, err)
	for _, lands := range []bool{false, true} {
		db := couchtest.UniqueName(t, "rec") + map[bool]string{false: "_quiet", true: "_lands"}[lands]
		cs.CreateDB(t, db)
		cs.Put(t, db, "a", map[string]any{"x": 1})
		h := NewRecorder(cc, r, logrus.New()).Wrap(func(ctx context.Context, job *worker.Job) error {
			page, err := cc.Changes(ctx, job.DB, couch.ChangesOptions{})
			if err != nil {
				return err
			}
			Vouch(ctx, page.LastSeq)
			if lands {
				cs.Put(t, db, "b", map[string]any{"x": 2}) // after the read, before the job ends
			}
			return nil
		})
		require.NoError(t, h(t.Context(), &worker.Job{Group: onc, DB: db}))
		done, err := r.Read(t.Context())
		require.NoError(t, err)
		info, err := cc.DBInfo(t.Context(), db)
		require.NoError(t, err)
		record := done[Key(onc, db)]
		due := len(done.Due(db, info.UpdateSeq, []events.Group{onc}, nil)) > 0
		if due && record != "" {
			// Another string (the same state, or not): the sweep asks CouchDB (producer's
			// stillDue).
			due, err = cc.ChangedSince(t.Context(), db, record)
			require.NoError(t, err)
		}
		if lands {
			assert.True(t, due, "the write after the read is not recorded done (record %q, update_seq %q)", record, info.UpdateSeq)
		} else {
			assert.False(t, due, "nothing landed: done (record %q, update_seq %q)", record, info.UpdateSeq)
		}
	}
}

// A record keeps the fingerprint of the rules it vouches for beside its seq; a record of other
// rules is due although its seq covers the db's, and one that names no rules (an earlier
// release's) vouches for whatever rules there are.
func TestRecordVouchesForItsRules(t *testing.T) {
	rep := events.GroupReplicate
	v := Value("5-g1AAAA", "aaaa")
	seq, rules := ParseValue(v)
	assert.Equal(t, "5-g1AAAA", seq)
	assert.Equal(t, "aaaa", rules)
	assert.Equal(t, "7", Value("7", ""), "no rules: the seq alone, as before")
	assert.True(t, Covered(v, "5-g1AAAA"))
	assert.False(t, RulesChanged(v, "aaaa"))
	assert.True(t, RulesChanged(v, "bbbb"))
	assert.True(t, RulesChanged(v, ""), "every rule of the group removed")
	assert.False(t, RulesChanged("5-g1AAAA", "bbbb"), "a record without rules")

	done := Done{Key(rep, "a"): v}
	same := func(events.Group) string { return "aaaa" }
	other := func(events.Group) string { return "bbbb" }
	assert.Empty(t, done.Due("a", "5-g1AAAA", []events.Group{rep}, same))
	assert.Equal(t, []events.Group{rep}, done.Due("a", "5-g1AAAA", []events.Group{rep}, other), "a rule added or edited since")
}
