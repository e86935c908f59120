package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// Gaps in what readers consume.
//
// Change streams and mirror buckets are output: readers may have read any message in them, so
// nothing here deletes a message, publishes a change out of order, or drops a key to mend a
// gap. Their durability is the storage layer's (NATS with sync_interval always, R3). What a job
// can see, it reports: a subject of our changes stream without messages that the rule stored
// there, or a mirror key without the write that the checkpoint records. The report is a metric
// (spiegel_output_gaps_total), a line in `producer status` naming the rule, the db and the
// range, and a log line, once per gap and process. An operator republishes additively with
// `producer replay`.
//
// One thing is published again on its own: the tail of a subject of our own changes stream
// (SPIEGEL_CHANGES, which install created) that lost its latest messages — after what the
// stream still holds, in feed order. That deletes and reorders nothing. On a stream we did not
// create, messages that are gone are their owner's business (consumed, purged, limited): nothing
// is published again and nothing is reported.

// Kinds of output a gap is reported in (the label of spiegel_output_gaps_total).
const (
	gapSubject = "subject"
	gapMirror  = "mirror"
)

// checkStream is a subject rule's first read of its subject in a job, before it publishes
// anything: the fence read (the subject's last message and its message count, at the stream's
// leader; see fence.go), and what it tells of a gap. It returns the seq the rule goes on from:
// since, or, when our own changes stream lost the latest messages the rule stored on the
// subject, the feed seq of the last message the subject still holds.
func (h *handler) checkStream(ctx context.Context, db string, rule *rules.OnChange, cps *checkpointWriter, since string, log logrus.FieldLogger) (string, error) {
	subject := subjectFor(rule, db)
	if !h.publisher.fenceable(rule, db) {
		return since, nil
	}
	f := fenceOf(ctx, subject)
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := h.publisher.readSubject(ctx, subject, rule.Timeout)
	if err != nil {
		return since, err
	}
	f.setRead(st)
	last, cp := st.last, cps.cp
	switch {
	case cp.Stream.Subject == subject && cp.Stream.Began:
		f.began, f.base, f.start = true, cp.Stream.Base, cp.Stream.Start
	case cps.fresh && cp.Stream.Seq == 0:
		// The rule's first run in this db (or in a db created again under its name): what the
		// subject holds now is not this db's.
		f.began, f.base, f.start = true, last.seq, since
	}
	if !h.publisher.ours(subject) {
		return since, nil
	}
	log = log.WithField("subject", subject)
	if missing, from, to, err := h.publisher.findGap(ctx, subject, st, rule.Timeout); err != nil {
		return since, err
	} else if missing > 0 {
		h.reportGap(gapSubject, rule.ID(), db, fmt.Sprintf("hole %d %d", missing, from),
			fmt.Sprintf("subject %s lacks %d of the messages at positions %d to %d", subject, missing, from, to), log)
	}
	if cp.Stream.Seq == 0 || cp.Stream.Subject != subject || last.seq >= cp.Stream.Seq || st.streamFirst > cp.Stream.Seq {
		return since, nil // nothing lost at the end, or dropped by the stream's own limits
	}
	key := fmt.Sprintf("tail %d %d", last.seq, cp.Stream.Seq)
	what := fmt.Sprintf("subject %s lost its latest messages: the last is at stream sequence %d, the rule had stored one at %d", subject, last.seq, cp.Stream.Seq)
	switch {
	case cp.Stream.Began && last.seq <= cp.Stream.Base:
		// Every change of this db the subject held is gone, and its last message (if any) is
		// one of an earlier db of the same name.
		h.reportGap(gapSubject, rule.ID(), db, key, what+"; publishing the db's changes again from the rule's start", log)
		return cp.Stream.Start, nil
	case last.feedSeq == "" && (last.seq > 0 || rule.Since == rules.SinceNow):
		h.reportGap(gapSubject, rule.ID(), db, key, what+"; where they start is not known: not published again (producer replay can)", log)
		return since, nil
	}
	h.reportGap(gapSubject, rule.ID(), db, key, what+"; publishing them again after it, in order", log)
	return last.feedSeq, nil
}

// ours reports whether subject is captured by our own changes stream (install created it).
func (p *changePublisher) ours(subject string) bool {
	name, ok := p.checked.get(subject)
	return ok && name == p.subjects.ChangesStream()
}

// findGap tells whether subject, whose state the caller read, lacks messages between its first
// and its last: the positions of its messages (events.PositionHeader) say how many it should
// hold. It returns how many are missing and between which positions (0: none). It costs no
// request unless the count falls short of the last message's position: then one read of the
// subject's first message, which tells the oldest messages dropped by the stream's limits (its
// previous message is before the stream's first) from lost ones. A subject whose messages carry
// no position (an earlier release published them) cannot be checked.
func (p *changePublisher) findGap(ctx context.Context, subject string, st subjectState, timeout time.Duration) (missing, from, to uint64, err error) {
	last, count := st.last, st.count
	if last.pos == 0 || count >= last.pos {
		return 0, 0, 0, nil
	}
	first, ok, err := p.nextMessage(ctx, subject, 1, timeout)
	if err != nil || !ok || first.pos == 0 || first.pos > last.pos {
		return 0, 0, 0, err
	}
	// The messages before the first were stored at or after its previous one; the stream's
	// limits drop the oldest first, so they cannot have dropped one at or after the stream's
	// first sequence.
	start := first.pos
	if first.pos > 1 && first.hasPrev && max(first.prev, 1) >= st.streamFirst {
		start = 1
	}
	span := last.pos - start + 1
	if span <= count {
		return 0, 0, 0, nil
	}
	return span - count, start, last.pos, nil
}

// checkMirror is a mirror rule's check, before it writes anything in a job, that the bucket
// still holds the rule's latest write in db as its checkpoint records it (cp.Stream: the key's
// subject and the write's sequence). A write the bucket acknowledged and lost (NATS restarted
// from an older store) is reported; nothing is dropped or written again for it (`producer replay`
// mirrors the db again). A write dropped by the bucket's own limits (max age, max bytes: below
// the stream's first sequence), or a key written again since, is no gap. One request per job
// (the message at the sequence, at the stream's leader), two when it is not there.
func (h *handler) checkMirror(ctx context.Context, db string, rule *rules.OnChange, cps *checkpointWriter, log logrus.FieldLogger) error {
	cp := cps.cp
	prefix := "$KV." + rule.Mirror + "."
	if rule.Mirror == "" || cp.Stream.Seq == 0 || !strings.HasPrefix(cp.Stream.Subject, prefix) {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, rule.Timeout)
	defer cancel()
	b, err := h.mirrors.bucket(ctx, rule.Mirror)
	if err != nil {
		return err
	}
	m, found, err := b.leaderMsg(ctx, map[string]any{"seq": cp.Stream.Seq}, fmt.Sprintf("read message %d", cp.Stream.Seq))
	switch {
	case err != nil:
		return fmt.Errorf("mirror %s: %w", rule.Mirror, err)
	case found && m.Subject == cp.Stream.Subject:
		return nil
	}
	key := strings.TrimPrefix(cp.Stream.Subject, prefix)
	last, found, err := b.leaderMsg(ctx, map[string]any{"last_by_subj": cp.Stream.Subject}, "read key "+key)
	switch {
	case err != nil:
		return fmt.Errorf("mirror %s: %w", rule.Mirror, err)
	case found && last.Seq > cp.Stream.Seq:
		return nil // the key was written again since
	}
	first, err := b.firstSeq(ctx)
	if err != nil {
		return fmt.Errorf("mirror %s: %w", rule.Mirror, err)
	}
	if first > cp.Stream.Seq {
		return nil // dropped by the bucket's own limits
	}
	h.reportGap(gapMirror, rule.ID(), db, fmt.Sprintf("mirror %d", cp.Stream.Seq), fmt.Sprintf("bucket %s lost the write of key %s at sequence %d", rule.Mirror, key, cp.Stream.Seq), log)
	return nil
}

// reportGap reports a gap in what rule keeps for db's readers (see the top of this file), what
// describing it: once per rule, db and key (the gap's identity) in this process, it counts one
// in the metric, notes it for `producer status` and logs it.
func (h *handler) reportGap(kind, rule, db, key, what string, log logrus.FieldLogger) {
	if h.gaps != nil && !h.gaps.firstTime(rule+"\x00"+db+"\x00"+key) {
		return
	}
	h.metrics.OutputGap(kind)
	h.status.Gap(rule, db, what)
	log.WithField("gap", kind).Error("a gap in what readers consume: " + what + " (see the runbook SpiegelOutputGap)")
}

// newGapSet returns the set of gaps a handler reported: each is reported again a day later
// while it lasts, and at most publisherMemory are held.
func newGapSet() *expiringSet { return newExpiringSet(reportedTTL, publisherMemory) }
