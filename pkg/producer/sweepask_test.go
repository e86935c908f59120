package producer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"golang.org/x/time/rate"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
)

// One state of one db on a three-node CouchDB 3.5.2 cluster (n=3, q=2), read with GET /{db}
// through one node: two answers, two different strings (as in pkg/couch).
var (
	clusterSeqA = "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMBuapFoaWCWjKkLp0mJDEn1UCNYwEYkJhkkmSeaYirPAgAhXCRx"
	clusterSeqB = "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV2MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMBukZSYlpyWjKkLp0mJDEn1UCNYwEZYppmnmJmbYCrPAgBfXCTv"
)

// fixedRecords is a doneReader over a fixed set of records.
type fixedRecords map[string]string

func (f fixedRecords) Read(context.Context) (reconcile.Done, error) { return reconcile.Done(f), nil }

func (f fixedRecords) Get(_ context.Context, g events.Group, db string) (string, error) {
	return f[reconcile.Key(g, db)], nil
}

// failingRecords is a doneReader whose reads fail.
type failingRecords struct{}

func (failingRecords) Read(context.Context) (reconcile.Done, error) {
	return nil, errors.New("no answer")
}

func (failingRecords) Get(context.Context, events.Group, string) (string, error) {
	return "", errors.New("no answer")
}

// A record of another string than the db's update_seq (CouchDB 2+ sends one state as different
// strings) is asked about: one _changes row since the record, once per distinct record, and
// only what changed is enqueued. The same string is never asked about, nor a missing record.
func TestSweepAsksCouchDBWhenStringsDiffer(t *testing.T) {
	both := []events.Group{events.GroupReplicate, events.GroupOnChange}
	for _, tc := range []struct {
		name      string
		records   map[events.Group]string
		seq       string
		answer    bool
		answerErr error
		wantAsked []string // the records asked about, in order
		wantDue   []events.Group
	}{
		{name: "another string, no change since the record: no job", seq: clusterSeqB,
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA},
			wantAsked: []string{clusterSeqA}},
		{name: "another string, a change since the record: both groups run", seq: clusterSeqB, answer: true,
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA},
			wantAsked: []string{clusterSeqA}, wantDue: both},
		{name: "no answer: both groups run", seq: clusterSeqB, answerErr: errors.New("connection refused"),
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA},
			wantAsked: []string{clusterSeqA}, wantDue: both},
		{name: "two records, each asked once", seq: clusterSeqB,
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: "7"},
			wantAsked: []string{clusterSeqA, "7"}},
		{name: "the same string: covered, not asked", seq: clusterSeqA,
			records: map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA}},
		{name: "integers, one behind: asked, due", seq: "12", answer: true,
			records:   map[events.Group]string{events.GroupReplicate: "7", events.GroupOnChange: "12"},
			wantAsked: []string{"7"}, wantDue: []events.Group{events.GroupReplicate}},
		{name: "a group without a record: due, not asked", seq: clusterSeqB,
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA},
			wantAsked: []string{clusterSeqA}, wantDue: []events.Group{events.GroupOnChange}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recs := fixedRecords{}
			for g, r := range tc.records {
				recs[reconcile.Key(g, "userdb")] = r
			}
			var asked []string
			p := &producer{
				done: &doneRecords{records: recs},
				log:  logrus.New(),
				askChanged: func(_ context.Context, db, since string) (bool, error) {
					assert.Equal(t, "userdb", db)
					asked = append(asked, since)
					return tc.answer, tc.answerErr
				},
			}
			due := p.stillDue(t.Context(), "userdb", tc.seq, both, nil)
			assert.ElementsMatch(t, tc.wantDue, due)
			assert.Equal(t, tc.wantAsked, asked)
		})
	}
}

// CouchDB's answer that a record and an update_seq are one state is remembered: the next sweeps
// do not ask again while neither string moves; a new update_seq, or a new record, is asked
// about once more, and an answer that the db changed is not remembered.
func TestSweepAsksOncePerRecordAndUpdateSeq(t *testing.T) {
	recs := fixedRecords{reconcile.Key(events.GroupOnChange, "userdb"): clusterSeqA}
	var asked []string
	changed := false
	p := &producer{
		done: &doneRecords{records: recs},
		log:  logrus.New(),
		askChanged: func(_ context.Context, _, since string) (bool, error) {
			asked = append(asked, since)
			return changed, nil
		},
	}
	onc := []events.Group{events.GroupOnChange}
	sweep := func(seq string) []events.Group { return p.stillDue(t.Context(), "userdb", seq, onc, nil) }
	assert.Empty(t, sweep(clusterSeqB))
	assert.Empty(t, sweep(clusterSeqB), "the same pair: not asked again")
	assert.Equal(t, []string{clusterSeqA}, asked)
	// With the record as the sweep read it, the remembered pair costs no key-value read either.
	p.done.records = failingRecords{}
	assert.Empty(t, p.stillDue(t.Context(), "userdb", clusterSeqB, onc, reconcile.Done(recs)), "answered without a read")
	p.done.records = recs

	changed = true
	assert.Equal(t, onc, sweep("6-later"), "a new update_seq is asked about")
	assert.Equal(t, onc, sweep("6-later"), "a change is not remembered: asked again, due again")
	assert.Len(t, asked, 3)

	changed = false
	recs[reconcile.Key(events.GroupOnChange, "userdb")] = "6-record"
	assert.Empty(t, sweep("6-later"), "a new record is asked about")
	assert.Empty(t, sweep("6-later"))
	assert.Len(t, asked, 4)
}

// A sweep that cannot read the completion records compares with the previous sweep's
// snapshot: a db whose update_seq is another string is asked about, so that a NATS outage does
// not give every idle db whose seq reads as another string (a cluster) a job.
func TestSweepWithoutRecordsAsksWhenStringsDiffer(t *testing.T) {
	var asked []string
	answer := false
	p := &producer{log: logrus.New(), askChanged: func(_ context.Context, _, since string) (bool, error) {
		asked = append(asked, since)
		return answer, nil
	}}
	ctx := t.Context()
	assert.False(t, p.changedSincePrev(ctx, "userdb", clusterSeqA, clusterSeqA))
	assert.False(t, p.changedSincePrev(ctx, "userdb", clusterSeqA, clusterSeqB), "another string, nothing since")
	answer = true
	assert.True(t, p.changedSincePrev(ctx, "userdb", clusterSeqA, clusterSeqB), "another string, a change since")
	assert.True(t, p.changedSincePrev(ctx, "userdb", "7", "8"))
	assert.Equal(t, []string{clusterSeqA, clusterSeqA, "7"}, asked)
	assert.True(t, p.changedSincePrev(ctx, "userdb", "", "8"), "a db the previous sweep did not list")
	assert.Len(t, asked, 3, "a missing seq is not asked about")
}

// The sweep's questions are paced: a sweep asks no faster than its limiter allows, and one
// whose context ends while it waits for its turn asks nothing more (the db counts as due).
func TestSweepAsksArePaced(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	asked := 0
	p := &producer{log: logrus.New(), asks: rate.NewLimiter(rate.Every(time.Hour), 3),
		askChanged: func(context.Context, string, string) (bool, error) {
			asked++
			if asked == 3 {
				cancel() // the sweep ends while the fourth question waits for its turn
			}
			return false, nil
		}}
	for range 3 {
		assert.False(t, p.changedSince(ctx, "userdb", clusterSeqA), "answered: no change")
	}
	assert.True(t, p.changedSince(ctx, "userdb", clusterSeqA), "not asked: due")
	assert.Equal(t, 3, asked, "the burst only")
}

// A record written after the sweep read the records (none then, or another one) is of a job that
// ended during the sweep: it covers the db as the sweep read it, and is not asked about. The
// record the sweep read is asked about as before.
func TestSweepTakesRecordsWrittenSinceItsRead(t *testing.T) {
	key := reconcile.Key(events.GroupOnChange, "userdb")
	onc := []events.Group{events.GroupOnChange}
	for _, tc := range []struct {
		name      string
		read      reconcile.Done
		wantAsked int
	}{
		{name: "no record when the sweep read them", read: reconcile.Done{}},
		{name: "another record when the sweep read them", read: reconcile.Done{key: "7"}},
		{name: "the record the sweep read", read: reconcile.Done{key: clusterSeqA}, wantAsked: 1},
		{name: "unknown what the sweep read", read: nil, wantAsked: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			asked := 0
			p := &producer{
				done: &doneRecords{records: fixedRecords{key: clusterSeqA}},
				log:  logrus.New(),
				askChanged: func(context.Context, string, string) (bool, error) {
					asked++
					return true, nil
				},
			}
			due := p.stillDue(t.Context(), "userdb", clusterSeqB, onc, tc.read)
			assert.Equal(t, tc.wantAsked, asked)
			if tc.wantAsked == 0 {
				assert.Empty(t, due, "covered by a job that ended during the sweep")
			} else {
				assert.Equal(t, onc, due, "asked: changed since")
			}
		})
	}
}
