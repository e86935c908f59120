package producer

import (
	"context"
	"errors"
	"testing"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
)

// One state of one db on a three-node CouchDB 3.5.2 cluster (n=3, q=2), read three times with
// GET /{db} through one node: three seqs naming different shard copies (as in pkg/couch).
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

// On a cluster a db's update_seq and its completion record name different shard copies about
// half the time, although nothing changed: the sweep asks CouchDB (one _changes row since the
// record, once per distinct record) and enqueues only what changed. Seqs it can order (the same
// copies, integers) are never asked about.
func TestSweepAsksCouchDBWhenCopiesDiffer(t *testing.T) {
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
		{name: "other copies, no change since the record: no job", seq: clusterSeqB,
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA},
			wantAsked: []string{clusterSeqA}},
		{name: "other copies, a change since the record: both groups run", seq: clusterSeqB, answer: true,
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA},
			wantAsked: []string{clusterSeqA}, wantDue: both},
		{name: "no answer: both groups run", seq: clusterSeqB, answerErr: errors.New("connection refused"),
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA},
			wantAsked: []string{clusterSeqA}, wantDue: both},
		{name: "two records, each asked once", seq: clusterSeqB,
			records:   map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: "3-unreadable"},
			wantAsked: []string{clusterSeqA}, wantDue: []events.Group{events.GroupOnChange}},
		{name: "the same copies: covered, not asked", seq: clusterSeqA,
			records: map[events.Group]string{events.GroupReplicate: clusterSeqA, events.GroupOnChange: clusterSeqA}},
		{name: "integers behind: due, not asked", seq: "12",
			records: map[events.Group]string{events.GroupReplicate: "7", events.GroupOnChange: "12"},
			wantDue: []events.Group{events.GroupReplicate}},
		{name: "a group without a record: due", seq: clusterSeqB,
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
			due := p.stillDue(t.Context(), "userdb", tc.seq, both)
			assert.ElementsMatch(t, tc.wantDue, due)
			assert.Equal(t, tc.wantAsked, asked)
		})
	}
	assert.True(t, couch.OtherCopies(couch.Seq(clusterSeqA), couch.Seq(clusterSeqB)), "the fixture's seqs name other copies")
}

// A sweep that cannot read the completion records compares with the previous sweep's
// snapshot: a db whose update_seq names other copies of the same state is no change (CouchDB
// is asked), so that a NATS outage does not give half of a cluster's idle dbs a job.
func TestSweepWithoutRecordsAsksWhenCopiesDiffer(t *testing.T) {
	var asked []string
	answer := false
	p := &producer{log: logrus.New(), askChanged: func(_ context.Context, _, since string) (bool, error) {
		asked = append(asked, since)
		return answer, nil
	}}
	ctx := t.Context()
	assert.False(t, p.changedSincePrev(ctx, "userdb", clusterSeqA, clusterSeqA))
	assert.False(t, p.changedSincePrev(ctx, "userdb", clusterSeqA, clusterSeqB), "other copies, nothing since")
	answer = true
	assert.True(t, p.changedSincePrev(ctx, "userdb", clusterSeqA, clusterSeqB), "other copies, a change since")
	assert.Equal(t, []string{clusterSeqA, clusterSeqA}, asked)
	assert.True(t, p.changedSincePrev(ctx, "userdb", "7", "8"))
	assert.True(t, p.changedSincePrev(ctx, "userdb", "", "8"), "a db the previous sweep did not list")
	assert.Len(t, asked, 2, "integers and a missing seq are not asked about")
}
