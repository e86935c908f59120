package chaos

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// writer runs the plan's operations against the source dbs. The ops of one db always run in the
// same lane (goroutine), in plan order, each not before its planned moment; a lane that falls
// behind (CouchDB restarting) catches up without skipping. An op that fails on the way (no
// answer, 5xx) is retried until it succeeds or ctx ends: an op may thus be applied twice, which
// only adds a revision. The writer never decides from the server's answers what to do next,
// only how (which rev to send), so the plan alone fixes what is written.
type writer struct {
	r       *run
	start   time.Time
	journal *journal // writer.log: every attempt of every op

	mu      sync.Mutex
	done    map[string]int // ops applied, by kind
	skipped map[string]int // ops whose doc was not in the planned state (e.g. no conflict left)
	retries int
	failed  []string // ops given up: ctx ended, or 5 answers the writer did not expect
	// dbsLost counts source dbs the server answered 404 for after acknowledging their
	// creation (PouchDB Server, SIGTERMed right after a PUT /db, can come back without the db):
	// the writer creates them again. A server fault, not the pipeline's: reported, not failed.
	dbsLost int

	dbDeleted map[string][]time.Duration // when the writer deleted each source db (run clock)
}

func newWriter(r *run, start time.Time) *writer {
	return &writer{r: r, start: start, journal: r.newJournal("writer"), done: map[string]int{}, skipped: map[string]int{},
		dbDeleted: map[string][]time.Duration{}}
}

// lane is one goroutine's share of the ops, with the revs it knows of its dbs' docs.
type lane struct {
	w    *writer
	revs map[string]map[string]string // db → doc id → winning rev as last written; "" = unknown
}

// run executes every op of the plan and returns when all are done or ctx ends.
func (w *writer) run(ctx context.Context, ops []Op) {
	lanes := make([][]Op, w.r.cfg.Lanes)
	for _, op := range ops {
		lanes[op.DB%len(lanes)] = append(lanes[op.DB%len(lanes)], op)
	}
	var wg sync.WaitGroup
	for _, l := range lanes {
		wg.Go(func() {
			ln := &lane{w: w, revs: map[string]map[string]string{}}
			for _, op := range l {
				if sleepCtx(ctx, time.Until(w.start.Add(op.At))) != nil {
					return
				}
				ln.apply(ctx, op)
			}
		})
	}
	wg.Wait()
}

// errRetry is a failure worth retrying: no answer, or a 5xx.
var errRetry = errors.New("retry")

// apply runs op until it succeeds or is skipped. A failure without an answer or with a 5xx is
// retried until ctx ends; any other (an answer the writer did not expect) at most 5 times,
// and then recorded as failed.
func (l *lane) apply(ctx context.Context, op Op) {
	odd := 0
	for attempt := 0; ; attempt++ {
		skipped, err := l.try(ctx, op)
		l.w.journal.printf("%s %s inc=%d doc=%d docs=%v attempt=%d skipped=%t err=%v", op.Kind, l.w.r.sourceDB(op.DB), op.Inc, op.Doc, op.Docs, attempt, skipped, err)
		if err != nil && !errors.Is(err, errRetry) {
			odd++
		}
		giveUp := ctx.Err() != nil || odd >= 5
		l.w.mu.Lock()
		switch {
		case err == nil && skipped:
			l.w.skipped[op.Kind.String()]++
		case err == nil:
			l.w.done[op.Kind.String()]++
		case giveUp:
			l.w.failed = append(l.w.failed, fmt.Sprintf("+%s %s %s doc=%d: %v", l.w.r.since(), op.Kind, l.w.r.sourceDB(op.DB), op.Doc, err))
		default:
			l.w.retries++
		}
		l.w.mu.Unlock()
		if err == nil || giveUp {
			return
		}
		_ = sleepCtx(ctx, min(time.Duration(attempt+1)*100*time.Millisecond, time.Second))
	}
}

// try runs op once. skipped means the doc was not in the state the op needs.
func (l *lane) try(ctx context.Context, op Op) (skipped bool, err error) {
	db := l.w.r.sourceDB(op.DB)
	c := l.w.r.couch
	id := docID(op.Inc, op.Doc)
	switch op.Kind {
	case OpCreateDB:
		// Whatever a deleted incarnation left (PouchDB Server brings a deleted db back to life
		// when a request writes into it, e.g. a replication that ran during the deletion) goes
		// first, with the target's.
		if err := l.deleteDBs(ctx, db); err != nil {
			return false, err
		}
		return false, l.createDB(ctx, db)
	case OpDeleteDB:
		return false, l.deleteDBs(ctx, db)
	case OpPut:
		return false, l.put(ctx, db, []int{op.Doc}, op)
	case OpBulk:
		return false, l.put(ctx, db, op.Docs, op)
	case OpDelete:
		rev, deleted, err := l.rev(ctx, db, id)
		if err != nil || rev == "" || deleted {
			return err == nil, err
		}
		var res struct {
			Rev string `json:"rev"`
		}
		status, err := c.do(ctx, http.MethodDelete, "/"+db+"/"+id+"?rev="+url.QueryEscape(rev), nil, &res)
		if status == http.StatusConflict || status == http.StatusNotFound {
			l.forget(db, id)
			return false, errRetry
		}
		if err := expect(status, err)(http.StatusOK, http.StatusAccepted); err != nil {
			return false, err
		}
		l.remember(db, id, res.Rev)
		l.w.journal.printf("  %s %s → %s (deleted)", db, id, res.Rev)
		return false, nil
	case OpConflict:
		var doc struct {
			Revisions struct {
				Start int      `json:"start"`
				IDs   []string `json:"ids"`
			} `json:"_revisions"`
		}
		status, err := c.do(ctx, http.MethodGet, "/"+db+"/"+id+"?revs=true", nil, &doc)
		if status == http.StatusNotFound {
			return true, nil
		}
		if err := expect(status, err)(http.StatusOK); err != nil {
			return false, err
		}
		if len(doc.Revisions.IDs) == 0 {
			return false, errors.New("doc without _revisions")
		}
		hash := fmt.Sprintf("%016x%016x", op.Salt, op.Salt*0x9e3779b97f4a7c15)
		gen := doc.Revisions.Start
		sib := map[string]any{"_id": id, "_rev": fmt.Sprintf("%d-%s", gen, hash),
			"_revisions": map[string]any{"start": gen, "ids": append([]string{hash}, doc.Revisions.IDs[1:]...)},
			"inc":        op.Inc, "k": op.Doc, "v": op.Salt, "sibling": true}
		l.forget(db, id) // the sibling may win
		return false, expect(c.do(ctx, http.MethodPost, "/"+db+"/_bulk_docs", map[string]any{"new_edits": false, "docs": []any{sib}}, nil))(http.StatusCreated, http.StatusAccepted)
	case OpResolve:
		var doc struct {
			Conflicts []string `json:"_conflicts"`
		}
		status, err := c.do(ctx, http.MethodGet, "/"+db+"/"+id+"?conflicts=true", nil, &doc)
		if status == http.StatusNotFound {
			return true, nil
		}
		if err := expect(status, err)(http.StatusOK); err != nil {
			return false, err
		}
		if len(doc.Conflicts) == 0 {
			return true, nil
		}
		status, err = c.do(ctx, http.MethodDelete, "/"+db+"/"+id+"?rev="+url.QueryEscape(doc.Conflicts[0]), nil, nil)
		if status == http.StatusConflict || status == http.StatusNotFound {
			return false, errRetry // resolved meanwhile (an earlier attempt that got no answer): look again
		}
		return false, expect(status, err)(http.StatusOK, http.StatusAccepted)
	}
	return false, fmt.Errorf("unknown op %d", op.Kind)
}

// createDB creates the source db (with the run's q on CouchDB); one that exists is fine.
func (l *lane) createDB(ctx context.Context, db string) error {
	c := l.w.r.couch
	path := "/" + db
	if !c.isPouch && l.w.r.cfg.Q > 0 {
		path += fmt.Sprintf("?q=%d", l.w.r.cfg.Q)
	}
	return expect(c.do(ctx, http.MethodPut, path, nil, nil))(http.StatusCreated, http.StatusAccepted, http.StatusPreconditionFailed)
}

// deleteDBs deletes the source db and then its target; a missing one is fine.
func (l *lane) deleteDBs(ctx context.Context, db string) error {
	delete(l.revs, db)
	l.w.mu.Lock()
	l.w.dbDeleted[db] = append(l.w.dbDeleted[db], l.w.r.since())
	l.w.mu.Unlock()
	for _, name := range []string{db, l.w.r.targetDB(db)} {
		if err := expect(l.w.r.couch.do(ctx, http.MethodDelete, "/"+name, nil, nil))(http.StatusOK, http.StatusAccepted, http.StatusNotFound); err != nil {
			return err
		}
	}
	return nil
}

// put creates or updates docs (one PUT, or one _bulk_docs for several). A doc whose rev the
// lane does not know, or whose write conflicts, is looked up and written again.
func (l *lane) put(ctx context.Context, db string, docs []int, op Op) error {
	c := l.w.r.couch
	body := func(k int, rev string) map[string]any {
		d := map[string]any{"_id": docID(op.Inc, k), "inc": op.Inc, "k": k, "v": op.Salt}
		if rev != "" {
			d["_rev"] = rev
		}
		return d
	}
	pending := docs
	for round := 0; len(pending) > 0; round++ {
		if round == 4 {
			return fmt.Errorf("docs %v of %s still conflict after 4 lookups", pending, db)
		}
		var batch []any
		for _, k := range pending {
			batch = append(batch, body(k, l.known(db, docID(op.Inc, k))))
		}
		var res []struct {
			ID, Rev, Error string
		}
		status, err := c.do(ctx, http.MethodPost, "/"+db+"/_bulk_docs", map[string]any{"docs": batch}, &res)
		if status == http.StatusNotFound {
			// The plan has the db live (a lane's ops on a db run in plan order, after its
			// create_db): the server lost it. Create it again and retry.
			l.w.journal.printf("  %s: 404 on a db the server acknowledged creating: creating it again", db)
			if err := l.createDB(ctx, db); err != nil {
				return err
			}
			l.w.mu.Lock()
			l.w.dbsLost++
			l.w.mu.Unlock()
			return errRetry
		}
		if err := expect(status, err)(http.StatusCreated, http.StatusAccepted); err != nil {
			return err
		}
		var again []int
		for i, r := range res {
			if i >= len(pending) {
				break
			}
			if r.Error != "" {
				l.w.journal.printf("  %s %s: %s (sent rev %q): looking it up", db, r.ID, r.Error, l.known(db, r.ID))
				l.forget(db, r.ID)
				rev, deleted, err := l.rev(ctx, db, r.ID)
				if err != nil {
					return err
				}
				if deleted {
					rev = ""
				}
				l.remember(db, r.ID, rev)
				again = append(again, pending[i])
				continue
			}
			l.remember(db, r.ID, r.Rev)
			l.w.journal.printf("  %s %s → %s", db, r.ID, r.Rev)
		}
		pending = again
	}
	return nil
}

// known returns the rev the lane last wrote for id ("" when unknown or deleted).
func (l *lane) known(db, id string) string { return l.revs[db][id] }

func (l *lane) remember(db, id, rev string) {
	if l.revs[db] == nil {
		l.revs[db] = map[string]string{}
	}
	l.revs[db][id] = rev
}

func (l *lane) forget(db, id string) { delete(l.revs[db], id) }

// rev returns id's winning rev, from the lane's memory or the server (_all_docs), and whether
// it is deleted; "" when the doc does not exist.
func (l *lane) rev(ctx context.Context, db, id string) (string, bool, error) {
	if rev := l.known(db, id); rev != "" {
		return rev, false, nil
	}
	var res struct {
		Rows []struct {
			Value struct {
				Rev     string `json:"rev"`
				Deleted bool   `json:"deleted"`
			} `json:"value"`
		} `json:"rows"`
	}
	status, err := l.w.r.couch.do(ctx, http.MethodPost, "/"+db+"/_all_docs", map[string]any{"keys": []string{id}}, &res)
	if err := expect(status, err)(http.StatusOK); err != nil {
		return "", false, err
	}
	if len(res.Rows) == 0 {
		return "", false, nil
	}
	return res.Rows[0].Value.Rev, res.Rows[0].Value.Deleted, nil
}

// expect turns a request's outcome into nil when its status is one of ok, errRetry when there
// was no answer or a 5xx, and an error naming the status otherwise.
func expect(status int, err error) func(ok ...int) error {
	return func(ok ...int) error {
		if err != nil {
			return fmt.Errorf("%w: %v", errRetry, err)
		}
		for _, s := range ok {
			if status == s {
				return nil
			}
		}
		if status == 0 || status >= 500 {
			return fmt.Errorf("%w: status %d", errRetry, status)
		}
		return fmt.Errorf("unexpected status %d", status)
	}
}

// deletions returns when the writer deleted each source db (or cleared it before a recreation).
func (w *writer) deletions() map[string][]time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string][]time.Duration{}
	for db, ts := range w.dbDeleted {
		out[db] = append([]time.Duration(nil), ts...)
	}
	return out
}

// stats returns the writer's counts.
func (w *writer) stats() (done, skipped map[string]int, retries int, failed []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	// Copies: the lanes go on counting while the caller reads them (reportProgress).
	return maps.Clone(w.done), maps.Clone(w.skipped), w.retries, append([]string(nil), w.failed...)
}

// lostDBs returns how often the server lost a db it had acknowledged creating.
func (w *writer) lostDBs() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.dbsLost
}
