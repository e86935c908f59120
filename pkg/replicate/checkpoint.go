package replicate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchpath"
)

// maxHistory bounds the sessions a checkpoint doc keeps, as CouchDB does.
const maxHistory = 50

// replicationIDVersion is written in checkpoint docs; our ids are not CouchDB's (version 3 and
// below use a node uuid), so the value names our own scheme.
const replicationIDVersion = 100

// historyEntry is one session of a checkpoint's history, CouchDB's field names.
type historyEntry struct {
	SessionID        string    `json:"session_id"`
	StartTime        string    `json:"start_time,omitempty"`
	EndTime          string    `json:"end_time,omitempty"`
	StartLastSeq     couch.Seq `json:"start_last_seq"`
	EndLastSeq       couch.Seq `json:"end_last_seq"`
	RecordedSeq      couch.Seq `json:"recorded_seq"`
	MissingChecked   int64     `json:"missing_checked"`
	MissingFound     int64     `json:"missing_found"`
	DocsRead         int64     `json:"docs_read"`
	DocsWritten      int64     `json:"docs_written"`
	DocWriteFailures int64     `json:"doc_write_failures"`
}

// checkpointDoc is the `_local/<replication id>` doc on source and target. Seqs are written as
// strings (PouchDB's integers are read back as their text) and never compared but for equality.
type checkpointDoc struct {
	Rev                  string         `json:"_rev,omitempty"`
	SessionID            string         `json:"session_id"`
	SourceLastSeq        couch.Seq      `json:"source_last_seq"`
	ReplicationIDVersion int            `json:"replication_id_version"`
	Engine               string         `json:"engine,omitempty"`
	History              []historyEntry `json:"history"`
}

// findStartSeq returns where a replication resumes and the history it continues, from the
// checkpoints read on source and target (nil when missing). Same session on both sides: the
// source's source_last_seq. Otherwise the histories are walked side by side, newest first, for
// the latest session both recorded (CouchDB's compare_rep_history). No common session: "" (the
// beginning) and an empty history.
func findStartSeq(src, tgt *checkpointDoc) (couch.Seq, []historyEntry) {
	if src == nil || tgt == nil {
		return "", nil
	}
	if src.SessionID != "" && src.SessionID == tgt.SessionID {
		return src.SourceLastSeq, src.History
	}
	s, t := src.History, tgt.History
	for len(s) > 0 && len(t) > 0 {
		s0, sRest := s[0], s[1:]
		t0, tRest := t[0], t[1:]
		if hasSession(t, s0.SessionID) {
			return s0.RecordedSeq, sRest
		}
		if hasSession(sRest, t0.SessionID) {
			return t0.RecordedSeq, tRest
		}
		s, t = sRest, tRest
	}
	return "", nil
}

func hasSession(h []historyEntry, id string) bool {
	if id == "" {
		return false
	}
	for _, e := range h {
		if e.SessionID == id {
			return true
		}
	}
	return false
}

// checkpointer reads and writes the checkpoint docs of one run on both sides. Not safe for
// concurrent use: the run's coordinator alone calls it.
type checkpointer struct {
	src, tgt *endpoint
	id       string // replication id
	session  string
	started  time.Time
	startSeq couch.Seq
	history  []historyEntry // the history this session continues (without its own entry)
	srcRev   string
	tgtRev   string
	written  couch.Seq // the last seq written to both sides
	deferred bool      // the final checkpoint was left to a later run
	// deferredSeq is where the run got to when its checkpoint was deferred
	deferredSeq couch.Seq
	// deferredBefore is the number of changes that deferred runs before this one read past the
	// checkpoints; deferredChanges adds this run's when it defers too
	deferredBefore, deferredChanges int
	// lastWritten is the doc this run last wrote on both sides (nil: none)
	lastWritten *checkpointDoc
	// lastSession is the session of the checkpoint both sides hold alike ("" if they differ)
	lastSession string
	// fence and token order the checkpoint writes of the replication's runs (nil: none)
	fence Fence
	token uint64
	// feedEnd is the end of the source's changes feed as this run read it, once every change
	// before it is on the target ("" until then)
	feedEnd couch.Seq
	// check verifies the cached checkpoint the run started from (nil: none, or done; see
	// run.targetCheck)
	check func(context.Context) error
}

// verify runs the verification of the cached checkpoint the run started from, once it passes
// (nil: nothing to verify). errTargetChanged: the target's doc is not the cached one.
func (c *checkpointer) verify(ctx context.Context) error {
	if c.check == nil {
		return nil
	}
	if err := c.check(ctx); err != nil {
		return err
	}
	c.check = nil
	return nil
}

// recent reports whether the checkpoint this run started from was written by an earlier run
// less than d ago, on both sides (same session), according to its history's end time.
func (c *checkpointer) recent(d time.Duration) bool {
	if d <= 0 || c.startSeq == "" || len(c.history) == 0 || c.lastSession == "" || c.history[0].SessionID != c.lastSession {
		return false
	}
	end, err := time.Parse(time.RFC1123, c.history[0].EndTime)
	if err != nil {
		return false
	}
	age := time.Since(end)
	return age >= -time.Minute && age < d // a clock far ahead is not trusted
}

// fewSince reports whether fewer than n changes, with the run's read ones, were read past the
// checkpoint this run started from, which both sides hold alike.
func (c *checkpointer) fewSince(n, read int) bool {
	return n > 0 && c.startSeq != "" && c.lastSession != "" && c.deferredBefore+read < n
}

func (c *checkpointer) path(e *endpoint) string {
	return e.dbPath + "/_local/" + couchpath.Segment(c.id)
}

// read reads the checkpoint doc of e; a missing doc is (nil, nil), and so is a missing db: the
// caller checks db existence (it costs a request that a present checkpoint makes unnecessary).
func (c *checkpointer) read(ctx context.Context, e *endpoint) (*checkpointDoc, error) {
	doc, _, err := c.readInDB(ctx, e)
	return doc, err
}

// readInDB is read that also tells whether the db is known to exist: true with a doc, and with a
// 404 whose reason is "missing" — the answer of CouchDB (1.x to 3.x) and PouchDB Server for a
// missing doc in a db that exists; a missing db is "Database does not exist." (CouchDB 2+),
// "no_db_file" (CouchDB 1.x, PouchDB Server). Any other 404 (a proxy's, say) tells nothing.
func (c *checkpointer) readInDB(ctx context.Context, e *endpoint) (doc *checkpointDoc, dbExists bool, err error) {
	var d checkpointDoc
	err = e.do(ctx, http.MethodGet, c.path(e), nil, nil, &d)
	var he *couch.HTTPError
	switch {
	case errors.As(err, &he) && errors.Is(err, couch.ErrNotFound):
		return nil, he.Reason == docMissing, nil
	case errors.Is(err, couch.ErrNotFound):
		return nil, false, nil
	case err != nil:
		return nil, false, fmt.Errorf("read checkpoint of %s: %w", e.shown, err)
	}
	return &d, true, nil
}

// docMissing is the reason of a 404 for a missing doc in a db that exists.
const docMissing = "missing"

// write records seq with stats as this session's checkpoint on both sides (in parallel), after
// verifying the cached checkpoint the run started from (errTargetChanged: nothing is written)
// and advancing the run's fencing token (Options.Fence): a run fenced there writes nothing.
// It must only be called once every change up to seq has been written to the target.
func (c *checkpointer) write(ctx context.Context, seq couch.Seq, st stats) error {
	if err := c.verify(ctx); err != nil {
		return err
	}
	entry := historyEntry{
		SessionID:        c.session,
		StartTime:        c.started.UTC().Format(time.RFC1123),
		EndTime:          time.Now().UTC().Format(time.RFC1123),
		StartLastSeq:     c.startSeq,
		EndLastSeq:       seq,
		RecordedSeq:      seq,
		MissingChecked:   st.MissingChecked,
		MissingFound:     st.MissingFound,
		DocsRead:         st.DocsRead,
		DocsWritten:      st.DocsWritten,
		DocWriteFailures: st.DocWriteFailures,
	}
	hist := append([]historyEntry{entry}, c.history...)
	if len(hist) > maxHistory {
		hist = hist[:maxHistory]
	}
	doc := checkpointDoc{
		SessionID:            c.session,
		SourceLastSeq:        seq,
		ReplicationIDVersion: replicationIDVersion,
		Engine:               EngineVersion,
		History:              hist,
	}
	if c.fence != nil {
		next, ok, err := c.fence.Advance(ctx, c.id, c.token)
		switch {
		case err != nil:
			return fmt.Errorf("advance the fencing token: %w", err)
		case !ok:
			return fmt.Errorf("write checkpoint: %w", ErrFenced)
		}
		c.token = next
	}
	var wg sync.WaitGroup
	var srcErr, tgtErr error
	wg.Add(2)
	go func() { defer wg.Done(); srcErr = c.put(ctx, c.src, doc, &c.srcRev) }()
	go func() { defer wg.Done(); tgtErr = c.put(ctx, c.tgt, doc, &c.tgtRev) }()
	wg.Wait()
	if err := errors.Join(srcErr, tgtErr); err != nil {
		return err
	}
	c.written, c.lastWritten = seq, &doc
	return nil
}

// withRev returns a copy of d with rev.
func (d checkpointDoc) withRev(rev string) checkpointDoc {
	d.Rev = rev
	return d
}

// put writes doc as e's checkpoint over *rev, the rev this run read or last wrote, and stores
// the new rev. A 409 (PouchDB Server checks the revs of _local docs; Apache CouchDB does not, see
// Options.Fence) means another run wrote the checkpoint since: ErrFenced, not retried.
func (c *checkpointer) put(ctx context.Context, e *endpoint, doc checkpointDoc, rev *string) error {
	doc.Rev = *rev
	var ans struct {
		Rev string `json:"rev"`
	}
	err := e.do(ctx, http.MethodPut, c.path(e), nil, doc, &ans)
	var he *couch.HTTPError
	switch {
	case errors.As(err, &he) && he.Status == http.StatusConflict:
		return fmt.Errorf("write checkpoint of %s: %w", e.shown, ErrFenced)
	case err != nil:
		return fmt.Errorf("write checkpoint of %s: %w", e.shown, err)
	}
	*rev = ans.Rev
	return nil
}
