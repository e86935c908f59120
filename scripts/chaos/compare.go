package chaos

import (
	"fmt"
	"slices"
	"strings"
)

// dbPair is a source db and its target as read at one moment (ok: the db exists).
type dbPair struct {
	src, tgt       map[string]docState
	srcOK, tgtOK   bool
	srcErr, tgtErr error
}

// compareDB compares one source with its target under the semantics of oracle.go and returns
// the (db, doc id, final winning rev) of the source's live incarnation, which the webhook and
// the change stream must have.
func (v *verdict) compareDB(src string, end dbEnd, p dbPair) (want [][3]string) {
	if !end.live {
		v.DeletedDBs++
		if p.srcOK {
			v.Resurrected = append(v.Resurrected, fmt.Sprintf("%s (%d docs)", src, len(p.src)))
		}
		v.Leftovers += len(p.tgt)
		if len(p.tgt) > 0 {
			v.LeftoverTargets++
		}
		return nil
	}
	v.LiveDBs++
	if !p.srcOK {
		v.ReplMismatch = append(v.ReplMismatch, src+": the source db is missing although the plan ends with it live")
		return nil
	}
	leftovers := 0
	for id := range p.tgt {
		if incarnation(id) != end.inc {
			leftovers++
		}
	}
	v.Leftovers += leftovers
	if leftovers > 0 {
		v.LeftoverTargets++
	}
	if !p.tgtOK && len(p.src) > 0 {
		v.ReplMismatch = append(v.ReplMismatch, fmt.Sprintf("%s: no target db (the source has %d docs)", src, len(p.src)))
	}
	for _, id := range sortedKeys(p.src) {
		d := p.src[id]
		if incarnation(id) != end.inc {
			v.Foreign = append(v.Foreign, fmt.Sprintf("%s/%s (live incarnation %d)", src, id, end.inc))
			continue
		}
		v.Docs++
		v.Leaves += len(d.Leaves)
		want = append(want, [3]string{src, id, d.Winner})
		t, ok := p.tgt[id]
		switch {
		case !p.tgtOK:
		case !ok:
			v.ReplMismatch = append(v.ReplMismatch, fmt.Sprintf("%s/%s: missing in the target (winner %s)", src, id, d.Winner))
		case t.Winner != d.Winner || t.Deleted != d.Deleted || !slices.Equal(t.Leaves, d.Leaves):
			v.ReplMismatch = append(v.ReplMismatch, fmt.Sprintf("%s/%s: source winner %s deleted=%t leaves %v; target winner %s deleted=%t leaves %v",
				src, id, d.Winner, d.Deleted, d.Leaves, t.Winner, t.Deleted, t.Leaves))
		}
	}
	for _, id := range sortedKeys(p.tgt) {
		if _, ok := p.src[id]; !ok && incarnation(id) == end.inc {
			v.ReplMismatch = append(v.ReplMismatch, fmt.Sprintf("%s/%s: in the target, not in the source", src, id))
		}
	}
	return want
}

// compareDeliveries checks that every wanted (db, doc, rev) was answered 200 at least once
// and counts the answers beyond the first.
func (v *verdict) compareDeliveries(want [][3]string, delivered map[[3]string]int) {
	v.HookExpected = len(want)
	for _, k := range want {
		if delivered[k] == 0 {
			v.HookMissing = append(v.HookMissing, strings.Join(k[:], " "))
		}
	}
	for _, n := range delivered {
		v.HookDuplicates += n - 1
	}
}

// compareSlowDeliveries checks that every wanted (db, doc, rev) of a db ruleSlow matches (slow)
// was answered 200 to ruleSlow at least once.
func (v *verdict) compareSlowDeliveries(want [][3]string, slow func(db string) bool, delivered map[[3]string]int) {
	for _, k := range want {
		if !slow(k[0]) {
			continue
		}
		v.SlowExpected++
		if delivered[k] == 0 {
			v.SlowMissing = append(v.SlowMissing, strings.Join(k[:], " "))
		}
	}
}

// compareStream checks that the change stream (msgs, in stream order) holds every wanted
// (db, doc, rev), counts messages stored twice under one message id, and checks the order: per
// db incarnation, the feed position (feedOrder) of the stored changes never goes back. A
// violation is reported against the highest position stored before it.
func (v *verdict) compareStream(msgs []streamMsg, want [][3]string) {
	v.StreamMsgs, v.StreamExpected = len(msgs), len(want)
	have := map[[3]string]bool{}
	ids := map[string]bool{}
	type key struct {
		db  string
		inc int
	}
	highest := map[key]streamMsg{}
	for _, m := range msgs {
		have[[3]string{m.DB, m.ID, m.Rev}] = true
		if ids[m.MsgID] {
			v.StreamDuplicates++
		}
		ids[m.MsgID] = true
		cur, ok := feedOrder(m.Feed)
		if !ok {
			v.Errors = append(v.Errors, fmt.Sprintf("stream seq %d: feed seq %q has no leading number", m.Seq, m.Feed))
			continue
		}
		k := key{m.DB, incarnation(m.ID)}
		if prev, seen := highest[k]; seen {
			if p, _ := feedOrder(prev.Feed); cur < p {
				v.OrderViolations = append(v.OrderViolations, orderViolation{DB: m.DB, ID: m.ID, PrevID: prev.ID, Feed: cur, PrevFeed: p,
					Seq: m.Seq, PrevSeq: prev.Seq, Stored: m.Stored, PrevStore: prev.Stored})
				continue
			}
		}
		highest[k] = m
	}
	for _, k := range want {
		if !have[k] {
			v.StreamMissing = append(v.StreamMissing, strings.Join(k[:], " "))
		}
	}
}

// compareMirror checks the doc-state mirror of a live source db's incarnation: each live doc's
// entry holds its winning revision, a deleted doc has none, and no entry names a doc the source
// does not have. Docs of earlier incarnations must be gone too (a recreated db's keys are dropped).
// A db the plan ends deleted is not checked: no job visits it, so its keys stay (documented).
func (v *verdict) compareMirror(src string, end dbEnd, p dbPair, entries map[string]string) {
	if !end.live || !p.srcOK {
		return
	}
	v.MirrorKeys += len(entries)
	for _, id := range sortedKeys(p.src) {
		d := p.src[id]
		if incarnation(id) != end.inc {
			continue // reported as foreign
		}
		rev, ok := entries[id]
		switch {
		case d.Deleted && ok:
			v.MirrorMismatch = append(v.MirrorMismatch, fmt.Sprintf("%s/%s: deleted (winner %s), the mirror holds %s", src, id, d.Winner, rev))
		case !d.Deleted && !ok:
			v.MirrorMismatch = append(v.MirrorMismatch, fmt.Sprintf("%s/%s: missing in the mirror (winner %s)", src, id, d.Winner))
		case !d.Deleted && rev != d.Winner:
			v.MirrorMismatch = append(v.MirrorMismatch, fmt.Sprintf("%s/%s: winner %s, the mirror holds %s", src, id, d.Winner, rev))
		}
	}
	ids := make([]string, 0, len(entries))
	for id := range entries {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		if _, ok := p.src[id]; !ok || incarnation(id) != end.inc {
			v.MirrorMismatch = append(v.MirrorMismatch, fmt.Sprintf("%s/%s: in the mirror (rev %s), not a doc of the source's live incarnation", src, id, entries[id]))
		}
	}
}
