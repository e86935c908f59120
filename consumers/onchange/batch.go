package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/webhook"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// change is one _changes row.
type change struct{ couch.Change }

// rev is the change's winning rev.
func (c change) rev() string {
	if len(c.Revs) > 0 {
		return c.Revs[0]
	}
	return ""
}

// vars decodes the row into substitution values: $change is the whole row (doc included, as an
// object), numbers keep their text (json.Number).
func (c change) vars(db string) (rules.Vars, map[string]any) {
	var doc map[string]any
	if len(c.Doc) > 0 {
		dec := json.NewDecoder(bytes.NewReader(c.Doc))
		dec.UseNumber()
		_ = dec.Decode(&doc) // a doc that does not decode matches as an empty one
	}
	revs := make([]any, 0, len(c.Revs))
	for _, r := range c.Revs {
		revs = append(revs, map[string]any{"rev": r})
	}
	row := map[string]any{"seq": c.Seq, "id": c.ID, "changes": revs}
	if c.Deleted {
		row["deleted"] = true
	}
	if doc != nil {
		row["doc"] = doc
	}
	return rules.VarsFromChange(db, row), doc
}

// action is what one change asks of a rule: an HTTP request or a publish.
type action struct {
	c       change
	key     string // identity for debounce and the retry book
	try     webhook.Attempt
	msg     *changeMsg     // subject rules: the message to publish (nil if it could not be built)
	details map[string]any // for a dead-letter record; never a password
	owner   int            // index of the action that covers this one (debounce), or its own
	since   string         // the seq just before the change: where a re-drive of its dead letter resumes
}

// batchResult is how far a batch got.
type batchResult struct {
	done     int // changes at the head of the batch acted on (succeeded or dead-lettered)
	retryIn  time.Duration
	deferErr error
	err      error
}

// Outcomes of one action.
const (
	stateDone     = iota + 1 // succeeded, or given up and dead-lettered
	stateDeferred            // retry due later
	stateFailed              // interrupted, or the dead letter could not be stored
)

// processBatch acts on the changes of one page in feed order (a mirror rule's writes as requests). Changes that fail the rule's `if`
// or selector are done at once. With debounce, identical requests (same method, final URL and
// body) are sent once: later ones are done when the first is. With block each request is sent
// after the previous one finished; without it up to requestConcurrency run at once. Subject
// rules publish strictly in feed order whatever block says (see publishBatch). No request is
// started after one has deferred or failed. The result's done counts the head of the batch that is
// finished, the only part the checkpoint may pass. since is the seq the page was read from;
// replay, when set, is the replay whose id subject rules publish the changes under.
func (h *handler) processBatch(ctx context.Context, db string, rule *rules.OnChange, since, replay string, rows []couch.Change, log logrus.FieldLogger) batchResult {
	acts := make([]*action, len(rows))
	seen := map[string]int{}
	prev := cmp.Or(since, "0")
	for i, row := range rows {
		a := h.newAction(db, rule, change{row}, replay)
		before := prev
		prev = row.Seq
		if a == nil {
			continue
		}
		a.owner, a.since = i, before
		if rule.Debounce && rule.Subject == "" && rule.Mirror == "" {
			if first, ok := seen[a.key]; ok {
				a.owner = first
			} else {
				seen[a.key] = i
			}
		}
		acts[i] = a
	}

	if rule.Subject != "" {
		return h.publishBatch(ctx, db, rule, acts, log)
	}
	// A mirror rule's writes go like requests: a page lists each doc once, so writes of one page
	// touch distinct keys and may run at once; a doc's next revision comes in a later page.

	states := make([]int, len(rows))
	var res batchResult
	var mu sync.Mutex
	var stop atomic.Bool
	run := func(i int) {
		st, retryIn, err := h.act(ctx, db, rule, acts[i], log)
		mu.Lock()
		defer mu.Unlock()
		states[i] = st
		switch st {
		case stateDeferred:
			stop.Store(true)
			if res.retryIn == 0 || retryIn < res.retryIn {
				res.retryIn, res.deferErr = retryIn, err
			}
		case stateFailed:
			stop.Store(true)
			if res.err == nil {
				res.err = err
			}
		}
	}
	limit := h.requestConcurrency
	if rule.Block || rule.Mirror != "" && h.mirrors.serial(rule.Mirror) {
		limit = 1
	}
	if rule.Mirror != "" && !rule.Block {
		// The writes that need no read go at once (mirrorWriter.writeWindow); the rest, and any
		// that failed, run as actions.
		written, err := h.mirrors.writeWindow(ctx, rule.Mirror, db, acts, rule.Timeout)
		for i, ok := range written {
			if ok {
				states[i] = stateDone
			}
		}
		if err != nil {
			stop.Store(true)
			res.err = err
		}
	}
	var todo []int // the actions to run, in feed order (a debounced one runs with its owner)
	for i, a := range acts {
		if a != nil && a.owner == i && states[i] != stateDone {
			todo = append(todo, i)
		}
	}
	// min(limit, len(todo)) goroutines take the actions in feed order, each checking before it
	// takes the next that none has deferred or failed. (A goroutine per action cost a goroutine
	// start and the growth of its stack to the HTTP client's depth per change: some 5 % of the
	// path's CPU at 20 changes a job.)
	var taken atomic.Int64
	work := func() {
		for !stop.Load() && ctx.Err() == nil {
			k := int(taken.Add(1)) - 1
			if k >= len(todo) {
				return
			}
			run(todo[k])
		}
	}
	if limit == 1 {
		work() // one at a time, in this goroutine
	} else {
		var wg sync.WaitGroup
		for range min(limit, len(todo)) {
			wg.Go(work)
		}
		wg.Wait()
	}

	for i, a := range acts {
		if a != nil && states[a.owner] != stateDone {
			break
		}
		res.done = i + 1
	}
	if res.err == nil && res.retryIn == 0 && res.done < len(rows) {
		res.err = ctx.Err() // only possible when the batch was cut short by ctx
	}
	return res
}

// publishBatch publishes the changes of a subject rule's page strictly in feed order (SPEC §5.3,
// §7.8), under the job's fence of the subject when the rule's subject is its db's own (see
// fence.go). When the subject's stream takes atomic pages (see takesAtomicPages), the page goes as
// one atomic batch: the stream stores all of it, in order, or nothing. Otherwise, or when the
// batch was refused for anything but the fence (a change the stream has already, a change too
// large, a lost answer), a fenced page goes in pipelined windows (see publishWindow), each of
// which the stream stores a prefix of, and the change a window stopped at, like every change of
// an unfenced page, is published alone, sent only once the stream confirmed the one before it; a publish that fails (a stream leader election, a NATS
// restart, a partition) is retried with the rule's retry policy before anything after it is sent
// (dead letter at its limit, as for webhooks). So the stream never stores a change after one that
// follows it in the feed. A publish whose answer was lost and that is sent again is deduplicated
// by its message id; a process that lost its job's lease sends nothing more (see act), and what
// it sent before and reaches the stream late is refused by the fence.
//
// Plain pipelined publishes (all at once, answers awaited in order) cannot keep that promise:
// when one of them is lost, the ones after it may be stored already. BenchmarkPublishPage
// compares the ways.
func (h *handler) publishBatch(ctx context.Context, db string, rule *rules.OnChange, acts []*action, log logrus.FieldLogger) batchResult {
	var res batchResult
	subject := subjectFor(rule, db)
	var f *fence
	if h.publisher.fenceable(rule, db) {
		f = fenceOf(ctx, subject)
		f.mu.Lock()
		defer f.mu.Unlock()
		if !f.read { // retried like a publish: a leader election or a NATS restart can fail it
			out := webhook.Retrying(ctx, webhook.Retry{Policy: rule.Retry, InlineMax: h.inlineRetry}, func(ctx context.Context) (int, error) {
				if !worker.Held(ctx) {
					return 0, worker.ErrLeaseLost
				}
				st, err := h.publisher.readSubject(ctx, subject, rule.Timeout)
				if err == nil {
					f.setRead(st)
				}
				return 0, err
			})
			switch {
			case out.Err == nil:
			case out.RetryIn > 0:
				res.retryIn, res.deferErr = out.RetryIn, fmt.Errorf("rule %s: %w", rule.ID(), out.Err)
				return res
			default:
				res.err = fmt.Errorf("rule %s: %w", rule.ID(), out.Err)
				return res
			}
		}
	}
	from := 0
	if h.publisher.takesAtomic(subject) {
		var err error
		from, err = h.publishAtomic(ctx, rule, acts, f, log)
		if errors.Is(err, errFenced) || errors.Is(err, worker.ErrLeaseLost) || ctx.Err() != nil {
			res.err = cmp.Or(ctx.Err(), err)
			return res
		}
	}
	for i := from; i < len(acts); i++ {
		a := acts[i]
		if a == nil {
			continue
		}
		if err := ctx.Err(); err != nil {
			res.done, res.err = i, err
			return res
		}
		if n := h.publishWindow(ctx, db, rule, acts[i:], f); n > 0 {
			i += n - 1 // the loop's i++ moves past the window
			continue
		}
		if f != nil && a.msg != nil {
			a.try = h.publisher.attemptFenced(*a.msg, f, rule.Timeout)
		}
		st, retryIn, err := h.act(ctx, db, rule, a, log)
		switch st {
		case stateDeferred:
			res.done, res.retryIn, res.deferErr = i, retryIn, err
			return res
		case stateFailed:
			res.done, res.err = i, err
			return res
		}
	}
	res.done = len(acts)
	return res
}

// publishWindow publishes the head of acts as one pipelined window under f (see
// changePublisher.publishWindow), when the job's last publish to the subject was stored and the
// head holds at least minWindow changes, up to the first that could not be encoded. It returns
// how many actions of the head are done (those whose changes the stream stored, and the changes
// the rule skips among them); 0: the next change goes alone.
func (h *handler) publishWindow(ctx context.Context, db string, rule *rules.OnChange, acts []*action, f *fence) int {
	size := h.publisher.windowSize(f, subjectFor(rule, db))
	if size < minWindow {
		return 0
	}
	var msgs []changeMsg
	var at []int // the index in acts of each of msgs
	stop := len(acts)
	for i, a := range acts {
		if a == nil {
			continue
		}
		if len(msgs) == size || a.msg == nil || h.booked(db, rule, a) {
			// a change that could not be encoded goes alone (its action says why), as does one
			// whose retry the book holds
			stop = i
			break
		}
		msgs, at = append(msgs, *a.msg), append(at, i)
	}
	if len(msgs) < minWindow {
		return 0
	}
	switch n := h.publisher.publishWindow(ctx, msgs, f, rule.Timeout); {
	case n == 0:
		return 0
	case n == len(msgs):
		return stop // the changes the rule skips up to the next that goes alone are done too
	default:
		return at[n-1] + 1
	}
}

// booked reports whether the retry book holds a's change for rule in db.
func (h *handler) booked(db string, rule *rules.OnChange, a *action) bool {
	if h.book.empty() {
		return false
	}
	_, _, found := h.book.get(bookKey(rule.ID(), db, a.c.ID, a.c.rev()))
	return found
}

// publishAtomic publishes the head of acts, up to the first change that could not be encoded, as
// one atomic batch (see changePublisher.publishAtomic) under f (nil: unfenced), and returns the
// index of the first action not stored: publishBatch goes on from there one change at a time (0
// when the batch was refused). err is the batch's error, if any.
func (h *handler) publishAtomic(ctx context.Context, rule *rules.OnChange, acts []*action, f *fence, log logrus.FieldLogger) (int, error) {
	var msgs []changeMsg
	end := len(acts)
	for i, a := range acts {
		if a == nil {
			continue
		}
		if a.msg == nil { // the change could not be encoded: its action says why, one at a time
			end = i
			break
		}
		msgs = append(msgs, *a.msg)
	}
	if len(msgs) < 2 {
		return 0, nil
	}
	if err := h.publisher.publishAtomic(ctx, msgs, f, rule.Timeout); err != nil {
		if !errors.Is(err, errFenced) {
			log.WithError(err).Debug("atomic batch refused: publishing the page one change at a time")
		}
		return 0, err
	}
	return end, nil
}

// newAction builds what rule does for change c, or nil when the doc does not match. A request
// that cannot be built becomes an action that fails permanently (and is dead-lettered).
func (h *handler) newAction(db string, rule *rules.OnChange, c change, replay string) *action {
	a := &action{c: c}
	output := rule.Mirror != "" || rule.Subject != ""
	if !output || len(rule.If) > 0 || rule.Selector != nil {
		// A webhook's request, or a filter, needs the doc decoded; a subject or mirror rule
		// without a filter takes the doc as CouchDB sent it.
		vars, doc := c.vars(db)
		if doc == nil {
			doc = map[string]any{"_id": c.ID}
			if c.Deleted {
				doc["_deleted"] = true
			}
		}
		if !rule.MatchDoc(doc) {
			return nil
		}
		if !output {
			return h.newRequest(a, rule, vars)
		}
	}
	if rule.Mirror != "" {
		a.key = "mirror " + c.ID + "/" + c.rev()
		a.details = map[string]any{"bucket": rule.Mirror, "key": mirrorkey.Encode(db, c.ID), "rev": c.rev()}
		a.try = h.mirrors.attempt(rule.Mirror, db, c, rule.Timeout)
		return a
	}
	if rule.Subject != "" {
		m, err := h.publisher.message(db, rule, c, replay)
		a.details = map[string]any{"subject": subjectFor(rule, db)}
		if err != nil {
			a.key, a.try = "unpublishable "+c.ID, func(context.Context) (int, error) { return 0, err }
			return a
		}
		a.key, a.msg, a.try = "publish "+m.id, &m, h.publisher.attempt(m, rule.Timeout)
		return a
	}
	return a
}

// newRequest makes a the webhook request of rule for its change, whose values are vars.
func (h *handler) newRequest(a *action, rule *rules.OnChange, vars rules.Vars) *action {
	req, err := webhook.Build(rule, vars)
	if err != nil {
		a.key, a.details = "invalid request", map[string]any{"url_template": logging.RedactURL(rule.URL)}
		a.try = func(context.Context) (int, error) { return 0, err }
		return a
	}
	a.key, a.details = req.Key(), map[string]any{"method": req.Method, "url": logging.RedactURL(req.URL)}
	a.try = func(ctx context.Context) (int, error) { return h.hooks.Send(ctx, req) }
	return a
}

// act runs one action with the rule's retry policy. A retry due later than inlineRetry is
// deferred (remembered in the retry book); at the retry limit the action is dead-lettered and
// counts as done.
func (h *handler) act(ctx context.Context, db string, rule *rules.OnChange, a *action, log logrus.FieldLogger) (int, time.Duration, error) {
	if !worker.Held(ctx) { // paused past AckWait: another instance may be acting on this db
		return stateFailed, 0, worker.ErrLeaseLost
	}
	key := func() string { return bookKey(rule.ID(), db, a.c.ID, a.c.rev()) } // built only when the book is used
	var done int
	var wait time.Duration
	var booked bool
	if !h.book.empty() { // the common case: no request deferred, no key to build
		done, wait, booked = h.book.get(key())
	}
	if wait > 0 {
		return stateDeferred, wait, nil
	}
	// Every attempt checks the lease first, not only the first one: a process paused during a
	// retry's backoff (SIGSTOP past AckWait) must not send the retry when it resumes, after the
	// instance that took the job over has sent later changes. Losing the lease interrupts the
	// retries (no dead letter).
	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	try := func(ctx context.Context) (int, error) {
		if !worker.Held(ctx) {
			cancel(worker.ErrLeaseLost)
			return 0, worker.ErrLeaseLost
		}
		n, err := a.try(ctx)
		if errors.Is(err, errFenced) { // retrying cannot help: the job runs again (see fence.go)
			cancel(err)
		}
		return n, err
	}
	out := webhook.Retrying(rctx, webhook.Retry{Policy: rule.Retry, Done: done, InlineMax: h.inlineRetry}, try)
	if out.Err == nil {
		if booked {
			h.book.forget(key())
		}
		return stateDone, 0, nil
	}
	log = log.WithFields(logrus.Fields{"seq": a.c.Seq, "doc_id": a.c.ID, "attempt": out.Attempts})
	switch {
	case out.RetryIn > 0:
		h.book.defer_(key(), out.Attempts, out.RetryIn)
		log.WithError(out.Err).WithField("delay", out.RetryIn.String()).Warn("request failed: retrying later")
		return stateDeferred, out.RetryIn, out.Err
	case !out.GaveUp:
		return stateFailed, 0, out.Err // ctx ended
	}
	rec := worker.DeadLetter{
		Group: events.GroupOnChange, DB: db, Rule: rule.ID(), Seq: a.c.Seq, Since: a.since, DocID: a.c.ID,
		Status: out.Status, Error: logging.RedactText(out.Err.Error()), Attempts: out.Attempts, Details: a.details,
	}
	if err := h.dead.Publish(ctx, rec); err != nil {
		h.book.defer_(key(), out.Attempts-1, 0) // one more attempt, then the record again
		return stateFailed, 0, err
	}
	h.book.forget(key())
	h.metrics.DeadLetter(events.GroupOnChange)
	h.status.GaveUp(rule.ID(), errors.New(rec.Error))
	log.WithError(out.Err).WithField("status", out.Status).Error("request given up at its retry limit: dead letter recorded")
	return stateDone, 0, nil
}
