package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
)

// The oracle's semantics of deleted and recreated source dbs:
//
//   - The writer deletes a source db and then its target db (as an operator retiring a db
//     would), and before recreating a source it deletes whatever is left of both (so the new
//     incarnation starts empty on both sides).
//   - Doc ids carry the incarnation ("i<inc>_d<k>"). Only the live incarnation (the one the plan
//     ends with) is checked: its docs must be in the target exactly (same doc ids, same leaf
//     revisions, deleted leaves and conflicts included, same winner), delivered to the webhook
//     with their final winning revision, and in the change stream.
//   - Docs of an earlier incarnation found in a target are leftovers: a replication that was
//     running while the writer deleted the dbs may write them back (no replicator can know of
//     the deletion). They are counted and reported, not failures. A source db the plan ends
//     deleted may likewise exist again, empty (PouchDB Server recreates a db a request writes
//     into): reported, not checked.

// dbEnd is the plan's final state of one source db.
type dbEnd struct {
	live bool
	inc  int
}

// finalState replays the plan's db-level ops.
func finalState(ops []Op, dbs int) []dbEnd {
	out := make([]dbEnd, dbs)
	for _, op := range ops {
		switch op.Kind {
		case OpCreateDB:
			out[op.DB] = dbEnd{live: true, inc: op.Inc}
		case OpDeleteDB:
			out[op.DB].live = false
		}
	}
	return out
}

// docState is one doc as a db's feed shows it.
type docState struct {
	Winner  string
	Deleted bool
	Leaves  []string // sorted, deleted leaves included
}

// readDB returns db's docs (from _changes and _changes?style=all_docs); exists is false for a
// missing db.
func (r *run) readDB(ctx context.Context, db string) (docs map[string]docState, exists bool, err error) {
	type rows struct {
		Results []struct {
			ID      string `json:"id"`
			Deleted bool   `json:"deleted"`
			Changes []struct {
				Rev string `json:"rev"`
			} `json:"changes"`
		} `json:"results"`
	}
	var main, all rows
	status, err := r.couch.do(ctx, http.MethodGet, "/"+db+"/_changes", nil, &main)
	if err == nil && status == http.StatusNotFound {
		return nil, false, nil
	}
	if err != nil || status != http.StatusOK {
		return nil, false, fmt.Errorf("read _changes of %s: status %d, %v", db, status, err)
	}
	if status, err := r.couch.do(ctx, http.MethodGet, "/"+db+"/_changes?style=all_docs", nil, &all); err != nil || status != http.StatusOK {
		return nil, false, fmt.Errorf("read _changes?style=all_docs of %s: status %d, %v", db, status, err)
	}
	docs = map[string]docState{}
	for _, row := range main.Results {
		if len(row.Changes) > 0 {
			docs[row.ID] = docState{Winner: row.Changes[0].Rev, Deleted: row.Deleted}
		}
	}
	for _, row := range all.Results {
		d := docs[row.ID]
		for _, c := range row.Changes {
			d.Leaves = append(d.Leaves, c.Rev)
		}
		sort.Strings(d.Leaves)
		docs[row.ID] = d
	}
	return docs, true, nil
}

// verdict is what the oracle found at one moment.
type verdict struct {
	LiveDBs, DeletedDBs, Docs, Leaves int
	ReplMismatch                      []string // target differs from its source (live incarnation)
	Leftovers, LeftoverTargets        int      // docs of earlier incarnations in targets
	Resurrected                       []string // sources the plan ends deleted that exist (empty)
	Foreign                           []string // source docs not of the live incarnation

	HookExpected   int
	HookMissing    []string // (db, doc, final rev) never answered 200
	HookDuplicates int      // 200 answers beyond the first per (db, doc, rev)

	SlowExpected int      // (db, doc, final rev) of the dbs ruleSlow matches
	SlowMissing  []string // of them, never answered 200 to ruleSlow

	StreamMsgs, StreamExpected int
	StreamRereads              int              // times the run read the change stream again from its start (see streamReader)
	StreamMissing              []string         // (db, doc, final rev) not in the change stream
	StreamDuplicates           int              // messages stored with a message id already stored
	OrderViolations            []orderViolation // a db incarnation's changes stored against feed order

	MirrorKeys     int      // keys of live source dbs in the doc-state mirror
	MirrorMismatch []string // a live doc whose mirror entry is not its winning revision (or a deleted doc's entry left)

	WorkPending uint64       // messages in the work stream (pending or in flight)
	DeadLetters []deadLetter // dead-letter records
	Errors      []string     // what could not be checked

	// storeLoss: the run had storage-loss faults on, after which the stream and the mirror may
	// keep gaps that were reported, not mended (gaps.go): convergence does not wait for them.
	storeLoss bool
}

// converged reports whether the pipeline has caught up with everything the writer did.
func (v *verdict) converged() bool {
	outputs := v.storeLoss || len(v.StreamMissing) == 0 && len(v.MirrorMismatch) == 0
	return len(v.ReplMismatch) == 0 && len(v.Foreign) == 0 && len(v.HookMissing) == 0 && len(v.SlowMissing) == 0 &&
		outputs && v.WorkPending == 0 && len(v.Errors) == 0
}

// deadLetter is one record of the dead-letter stream. Accounted says why the run expected it
// ("" = unexpected: a failure).
type deadLetter struct {
	Seq                                      uint64
	Group, Rule, DB, DocID, Error, Accounted string
	Status                                   int
	At                                       time.Time
}

func (d deadLetter) String() string {
	s := fmt.Sprintf("#%d group=%s rule=%s db=%s doc=%s status=%d at=%s error=%s", d.Seq, d.Group, d.Rule, d.DB, d.DocID, d.Status,
		d.At.Format("15:04:05.000"), d.Error)
	if d.Accounted != "" {
		s += " — accounted: " + d.Accounted
	}
	return s
}

// orderViolation is a change stored after one that follows it in its db's feed: always a
// failure.
type orderViolation struct {
	DB, ID, PrevID    string
	Feed, PrevFeed    int64
	Seq, PrevSeq      uint64
	Stored, PrevStore time.Time
}

func (o orderViolation) String() string {
	return fmt.Sprintf("%s: %s (feed seq %d, stream seq %d, stored %s) after %s (feed seq %d, stream seq %d, stored %s)",
		o.DB, o.ID, o.Feed, o.Seq, o.Stored.Format("15:04:05.000"), o.PrevID, o.PrevFeed, o.PrevSeq, o.PrevStore.Format("15:04:05.000"))
}

// orderViolations returns the order violations, every one a failure.
func (v *verdict) orderViolations() []string {
	var out []string
	for _, o := range v.OrderViolations {
		out = append(out, o.String())
	}
	return out
}

// unaccounted returns the dead letters the run did not expect.
func (v *verdict) unaccounted() []string {
	var out []string
	for _, d := range v.DeadLetters {
		if d.Accounted == "" {
			out = append(out, d.String())
		}
	}
	return out
}

// pending says what keeps the verdict from converging, with the first item of each kind.
func (v *verdict) pending(ready bool) string {
	var parts []string
	add := func(what string, items []string) {
		if len(items) > 0 {
			parts = append(parts, fmt.Sprintf("%s %d (%s)", what, len(items), items[0]))
		}
	}
	add("replication mismatches", v.ReplMismatch)
	add("foreign docs", v.Foreign)
	add("webhook missing", v.HookMissing)
	add("block rule missing", v.SlowMissing)
	add("change stream missing", v.StreamMissing)
	add("mirror mismatches", v.MirrorMismatch)
	add("errors", v.Errors)
	if v.WorkPending > 0 {
		parts = append(parts, fmt.Sprintf("work stream holds %d", v.WorkPending))
	}
	if !ready {
		parts = append(parts, "a process is not ready")
	}
	return strings.Join(parts, "; ")
}

// check reads every source and target db, the sink's deliveries and the change stream, and
// compares them (see the semantics above).
func (r *run) check(ctx context.Context) *verdict {
	v := &verdict{storeLoss: r.cfg.StoreLoss}
	ends := finalState(r.plan.Ops, r.cfg.DBs)
	pairs := make([]dbPair, r.cfg.DBs)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range pairs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			p := &pairs[i]
			p.src, p.srcOK, p.srcErr = r.readDB(ctx, r.sourceDB(i))
			p.tgt, p.tgtOK, p.tgtErr = r.readDB(ctx, r.targetDB(r.sourceDB(i)))
		})
	}
	wg.Wait()

	mirror, err := r.readMirror(ctx)
	if err != nil {
		v.Errors = append(v.Errors, "read the mirror: "+err.Error())
	}
	var want [][3]string
	for i, p := range pairs {
		if p.srcErr != nil || p.tgtErr != nil {
			v.Errors = append(v.Errors, fmt.Sprint(errorsOf(p.srcErr, p.tgtErr)))
			continue
		}
		want = append(want, v.compareDB(r.sourceDB(i), ends[i], p)...)
		if err == nil {
			v.compareMirror(r.sourceDB(i), ends[i], p, mirror[r.sourceDB(i)])
		}
	}
	v.compareDeliveries(want, r.sink.delivered())
	v.compareSlowDeliveries(want, r.slowDB, r.sink.slowDelivered())
	if _, err := r.changes.catchUp(ctx); err != nil {
		v.Errors = append(v.Errors, "read the change stream: "+err.Error())
	}
	v.compareStream(r.changes.all(), want)
	v.StreamRereads = r.changes.rereadCount()
	r.checkQueues(ctx, v)
	return v
}

// readMirror returns the doc-state mirror of ruleMirror: per db, per doc id, the revision its
// entry holds (deleted docs have none). A bucket not created yet is empty.
func (r *run) readMirror(ctx context.Context) (map[string]map[string]string, error) {
	out := map[string]map[string]string{}
	kv, err := r.nats.js.KeyValue(ctx, mirrorBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	w, err := kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return nil, err
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("bucket %s: %w", mirrorBucket, ctx.Err())
		case e := <-w.Updates():
			if e == nil { // the current values are all read
				return out, nil
			}
			if strings.HasPrefix(e.Key(), mirrorkey.FencePrefix) { // a db's fence, not a doc
				continue
			}
			db, id, err := mirrorkey.Decode(e.Key())
			if err != nil {
				return nil, fmt.Errorf("bucket %s: key %q: %w", mirrorBucket, e.Key(), err)
			}
			var doc struct {
				Rev string `json:"_rev"`
			}
			if err := json.Unmarshal(e.Value(), &doc); err != nil {
				return nil, fmt.Errorf("bucket %s: key %q: %w", mirrorBucket, e.Key(), err)
			}
			if out[db] == nil {
				out[db] = map[string]string{}
			}
			out[db][id] = doc.Rev
		}
	}
}

// checkQueues reads the work stream's depth and the dead-letter records.
func (r *run) checkQueues(ctx context.Context, v *verdict) {
	for _, name := range []string{r.subjects.WorkStream(), r.subjects.DeadLetterStream()} {
		st, err := r.nats.js.Stream(ctx, name)
		if err != nil {
			v.Errors = append(v.Errors, fmt.Sprintf("stream %s: %v", name, err))
			continue
		}
		info, err := st.Info(ctx)
		if err != nil {
			v.Errors = append(v.Errors, fmt.Sprintf("stream %s: %v", name, err))
			continue
		}
		if name == r.subjects.WorkStream() {
			v.WorkPending = info.State.Msgs
			continue
		}
		for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if err != nil {
				v.Errors = append(v.Errors, fmt.Sprintf("dead letter #%d: %v", seq, err))
				continue
			}
			d := deadLetter{Seq: seq}
			var rec struct {
				Group, Rule, DB, Error string
				DocID                  string    `json:"doc_id"`
				Status                 int       `json:"status"`
				At                     time.Time `json:"at"`
			}
			if err := json.Unmarshal(m.Data, &rec); err != nil {
				d.Error = fmt.Sprintf("(undecodable: %q)", m.Data)
			}
			d.Group, d.Rule, d.DB, d.DocID, d.Status, d.Error, d.At = rec.Group, rec.Rule, rec.DB, rec.DocID, rec.Status, rec.Error, rec.At
			v.DeadLetters = append(v.DeadLetters, d)
		}
	}
}

func sortedKeys(m map[string]docState) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func errorsOf(errs ...error) []string {
	var out []string
	for _, e := range errs {
		if e != nil {
			out = append(out, e.Error())
		}
	}
	return out
}

// account marks the dead letters the run expects: a replication of a source db that the writer
// deleted while it ran (the replication found the db gone). The deletion is the writer's start
// of it, so a record may come a little before it. No feed-order violation is ever expected: a
// subject rule's stream holds each (rule, db)'s changes strictly in feed order, through NATS
// outages and stream leader elections too.
func account(v *verdict, deleted map[string][]time.Duration, started time.Time) {
	for i := range v.DeadLetters {
		d := &v.DeadLetters[i]
		if d.Group != "replicate" {
			continue
		}
		at := d.At.Sub(started)
		var before, after []time.Duration // deletions up to a minute before the record, and within a second after
		for _, t := range deleted[d.DB] {
			switch {
			case t <= at && at-t <= time.Minute:
				before = append(before, t)
			case t > at && t-at <= time.Second:
				after = append(after, t)
			}
		}
		switch {
		case len(before) > 0:
			t := slices.Max(before)
			d.Accounted = fmt.Sprintf("the writer deleted %s at +%s, %s before the record", d.DB, t, (at - t).Round(time.Millisecond))
		case len(after) > 0:
			t := slices.Min(after)
			d.Accounted = fmt.Sprintf("the writer deleted %s at +%s, %s after the record (the requests raced)", d.DB, t, (t - at).Round(time.Millisecond))
		}
	}
}
