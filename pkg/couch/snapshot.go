package couch

import (
	"context"
	"fmt"
	"sort"
)

// Snapshot maps each db to its update_seq (opaque) at one moment.
type Snapshot map[string]string

// TakeSnapshot lists every db (EachDB) and reads the update_seq of those for which match
// returns true (nil matches all) through DBInfos: batched POST /_dbs_info where supported, GET
// /{db} with bounded concurrency elsewhere. A db deleted while the snapshot is taken is absent.
func (c *Client) TakeSnapshot(ctx context.Context, match func(db string) bool) (Snapshot, error) {
	return c.takeSnapshot(ctx, match, dbsInfoBatch)
}

func (c *Client) takeSnapshot(ctx context.Context, match func(db string) bool, batch int) (Snapshot, error) {
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
	infos, err := c.dbInfos(ctx, dbs, batch)
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
// for a db only in next, updated for a db whose update_seq differs (one state packed in another
// order, each covering the other, is no update; a seq going back, a db recreated, is one),
// deleted for a db only in prev. A nil prev is empty: every db of next is created.
func Diff(prev, next Snapshot) []DBEvent {
	var out []DBEvent
	for db, seq := range next {
		old, ok := prev[db]
		switch {
		case !ok:
			out = append(out, DBEvent{DB: db, Type: EventCreated})
		case !SameState(Seq(old), Seq(seq)):
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
