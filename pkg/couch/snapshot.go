package couch

import (
	"context"
	"fmt"
	"maps"
	"sort"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
)

// Snapshot maps each db to its update_seq (opaque) at one moment.
type Snapshot map[string]string

// TakeSnapshot lists every db (EachDB) and reads the update_seq of those for which match
// returns true (nil matches all) through DBInfos: batched POST /_dbs_info where supported, GET
// /{db} with bounded concurrency elsewhere. A db deleted while the snapshot is taken is absent.
func (c *Client) TakeSnapshot(ctx context.Context, match func(db string) bool) (Snapshot, error) {
	return c.takeSnapshot(ctx, match, dbsInfoBatch, 0)
}

// TakeSnapshotSpread is TakeSnapshot with the infos read one batch (100 dbs) at a time, the
// batches spread evenly over spread but never more than maxSpreadGap apart, so that a few
// hundred dbs take a second or two, not the whole spread (0: TakeSnapshot): the reconciliation
// sweep's way. At once, 10,000 dbs are some 100 requests that make CouchDB 3 open every db's
// shards within seconds, which slowed everything else it served meanwhile, its own _db_updates
// feed included (bench-e2e at N = 10,000: the writes during a sweep waited up to 200 ms longer
// for their row). Spread, the same requests come a few a second. A db's seq read early is no worse: a job's completion
// record at a later seq covers it (reconcile.Covered).
func (c *Client) TakeSnapshotSpread(ctx context.Context, match func(db string) bool, spread time.Duration) (Snapshot, error) {
	return c.takeSnapshot(ctx, match, dbsInfoBatch, spread)
}

func (c *Client) takeSnapshot(ctx context.Context, match func(db string) bool, batch int, spread time.Duration) (Snapshot, error) {
	var dbs []string
	err := c.EachDB(ctx, func(db string) error {
		if match == nil || match(db) {
			dbs = append(dbs, db)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("take snapshot: %w", err)
	}
	infos, err := c.dbInfosSpread(ctx, dbs, batch, spread)
	if err != nil {
		return nil, fmt.Errorf("take snapshot: %w", err)
	}
	snap := make(Snapshot, len(infos))
	for db, info := range infos {
		snap[db] = info.UpdateSeq
	}
	return snap, nil
}

// Diff returns the events that lead from prev to next, sorted by db name, with Seq "": created
// for a db only in next, updated for a db whose update_seq is another string (seqs are opaque:
// one state sent as another string is an update here too; the poll source asks CouchDB before
// it reports one, see pollFeed.confirm), deleted for a db only in prev. A nil prev is empty:
// every db of next is created.
func Diff(prev, next Snapshot) []DBEvent {
	var out []DBEvent
	for db, seq := range next {
		old, ok := prev[db]
		switch {
		case !ok:
			out = append(out, DBEvent{DB: db, Type: EventCreated})
		case old != seq:
			out = append(out, DBEvent{DB: db, Type: EventUpdated})
		}
	}
	for db := range prev {
		if _, ok := next[db]; !ok {
			out = append(out, DBEvent{DB: db, Type: EventDeleted})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].DB < out[j].DB })
	return out
}

// maxSpreadGap is the longest wait between two batches of a spread snapshot: at least 200 dbs'
// infos a second.
const maxSpreadGap = 500 * time.Millisecond

// dbInfosSpread is dbInfos one batch at a time, spread evenly over spread, at most maxSpreadGap
// apart (0: dbInfos).
func (c *Client) dbInfosSpread(ctx context.Context, dbs []string, batch int, spread time.Duration) (map[string]DBInfo, error) {
	if batch <= 0 || batch > dbsInfoBatch {
		batch = dbsInfoBatch
	}
	if spread <= 0 || len(dbs) <= batch {
		return c.dbInfos(ctx, dbs, batch)
	}
	batches := (len(dbs) + batch - 1) / batch
	gap := min(spread/time.Duration(batches), maxSpreadGap)
	out := make(map[string]DBInfo, len(dbs))
	for i := range batches {
		if i > 0 {
			if err := backoff.Sleep(ctx, gap); err != nil {
				return nil, err
			}
		}
		part, err := c.dbInfos(ctx, dbs[i*batch:min((i+1)*batch, len(dbs))], batch)
		if err != nil {
			return nil, err
		}
		maps.Copy(out, part)
	}
	return out, nil
}
