package chaos

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// The oracle must see every kind of difference it claims to, or the chaos run could not fail.
func TestCompareDBSeesDifferences(t *testing.T) {
	t.Parallel()
	doc := func(winner string, deleted bool, leaves ...string) docState {
		return docState{Winner: winner, Deleted: deleted, Leaves: leaves}
	}
	src := map[string]docState{
		"i1_d0000": doc("2-b", false, "2-a", "2-b"),
		"i1_d0001": doc("3-c", true, "3-c"),
	}
	for _, c := range []struct {
		name         string
		tgt          map[string]docState
		tgtOK        bool
		mismatches   int
		leftovers    int
		wantDelivery int
	}{
		{"equal", map[string]docState{"i1_d0000": doc("2-b", false, "2-a", "2-b"), "i1_d0001": doc("3-c", true, "3-c")}, true, 0, 0, 2},
		{"leftovers of incarnation 0 are not mismatches", map[string]docState{"i1_d0000": doc("2-b", false, "2-a", "2-b"),
			"i1_d0001": doc("3-c", true, "3-c"), "i0_d0000": doc("1-x", false, "1-x")}, true, 0, 1, 2},
		{"a conflict leaf missing", map[string]docState{"i1_d0000": doc("2-b", false, "2-b"), "i1_d0001": doc("3-c", true, "3-c")}, true, 1, 0, 2},
		{"a deletion not replicated", map[string]docState{"i1_d0000": doc("2-b", false, "2-a", "2-b"), "i1_d0001": doc("2-y", false, "2-y")}, true, 1, 0, 2},
		{"a doc missing", map[string]docState{"i1_d0000": doc("2-b", false, "2-a", "2-b")}, true, 1, 0, 2},
		{"a doc the source does not have", map[string]docState{"i1_d0000": doc("2-b", false, "2-a", "2-b"),
			"i1_d0001": doc("3-c", true, "3-c"), "i1_d0009": doc("1-z", false, "1-z")}, true, 1, 0, 2},
		{"no target", nil, false, 1, 0, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			v := &verdict{}
			want := v.compareDB("db", dbEnd{live: true, inc: 1}, dbPair{src: src, tgt: c.tgt, srcOK: true, tgtOK: c.tgtOK})
			assert.Len(t, v.ReplMismatch, c.mismatches, "%v", v.ReplMismatch)
			assert.Equal(t, c.leftovers, v.Leftovers)
			assert.Len(t, want, c.wantDelivery)
		})
	}

	v := &verdict{}
	v.compareDB("db", dbEnd{live: true, inc: 2}, dbPair{src: src, srcOK: true, tgtOK: true})
	assert.Len(t, v.Foreign, 2, "source docs of another incarnation than the live one")

	v = &verdict{}
	assert.Empty(t, v.compareDB("db", dbEnd{live: false, inc: 1}, dbPair{srcOK: true, tgt: src, tgtOK: true}))
	assert.Equal(t, 2, v.Leftovers, "a deleted db's target holds only leftovers")
	assert.Len(t, v.Resurrected, 1)
}

func TestCompareDeliveriesAndStream(t *testing.T) {
	t.Parallel()
	want := [][3]string{{"db", "i0_d0000", "2-a"}, {"db", "i0_d0001", "1-b"}}
	v := &verdict{}
	v.compareDeliveries(want, map[[3]string]int{{"db", "i0_d0000", "2-a"}: 3, {"db", "i0_d0000", "1-old"}: 1})
	assert.Equal(t, []string{"db i0_d0001 1-b"}, v.HookMissing)
	assert.Equal(t, 2, v.HookDuplicates)

	msg := func(seq uint64, id, rev, feed string) streamMsg {
		return streamMsg{Seq: seq, MsgID: "db/" + id + "/" + rev, DB: "db", ID: id, Rev: rev, Feed: feed}
	}
	v = &verdict{}
	v.compareStream([]streamMsg{
		msg(1, "i0_d0000", "1-x", "1"),
		msg(2, "i0_d0001", "1-b", "2-g1AAAA"),
		msg(3, "i0_d0000", "2-a", "5"),
		msg(4, "i0_d0000", "2-a", "5"), // stored twice: a duplicate
		msg(5, "i1_d0000", "1-n", "1"), // another incarnation starts its own order
		msg(6, "i0_d0002", "1-c", "3"), // after feed seq 5: out of order
	}, want)
	assert.Empty(t, v.StreamMissing)
	assert.Equal(t, 1, v.StreamDuplicates)
	assert.Len(t, v.OrderViolations, 1, "%v", v.OrderViolations)
	assert.Empty(t, v.Errors)
	v.StreamMissing = nil
	account(v, nil, time.Now())
	assert.False(t, (&Result{Verdict: v}).Pass(), "a feed-order violation fails the run, whenever it was stored")
	v.OrderViolations = nil
	assert.True(t, (&Result{Verdict: v}).Pass(), "and only it")

	v = &verdict{}
	v.compareStream([]streamMsg{msg(1, "i0_d0000", "2-a", "x")}, want)
	assert.Equal(t, []string{"db i0_d0001 1-b"}, v.StreamMissing)
	assert.Len(t, v.Errors, 1, "a seq without a number cannot be ordered")
}

func TestFeedOrderAndIncarnation(t *testing.T) {
	t.Parallel()
	for seq, want := range map[string]int64{"12": 12, `"7"`: 7, "34-g1AAAABPeJzLYWBgYMxgTmEQ": 34} {
		n, ok := feedOrder(seq)
		assert.True(t, ok, seq)
		assert.Equal(t, want, n, seq)
	}
	_, ok := feedOrder("g1AAAA")
	assert.False(t, ok)
	assert.Equal(t, 3, incarnation(docID(3, 7)))
	assert.Equal(t, -1, incarnation("spiegel_cp_x"))
}
