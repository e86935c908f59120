package couchtest

import (
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var seqShape = regexp.MustCompile(`^[0-9]+-g1AAAA[A-Za-z0-9_-]+$`)

func TestUpdatesLogSeqsParseBackOnlyInTheirOwnLog(t *testing.T) {
	t.Parallel()
	l, other := newUpdatesLog(0), newUpdatesLog(0)
	t.Cleanup(l.close)
	t.Cleanup(other.close)
	for i := range 3 {
		l.record("db"+strconv.Itoa(i), updateCreated)
		other.record("db"+strconv.Itoa(i), updateCreated)
	}
	require.Equal(t, uint64(3), l.last())

	for n := range uint64(4) {
		s := l.encode(n)
		assert.Regexp(t, seqShape, s)
		got, ok := l.parse(s)
		assert.True(t, ok, "own seq %s", s)
		assert.Equal(t, n, got)
	}
	for _, s := range []string{"", "0"} {
		got, ok := l.parse(s)
		assert.True(t, ok, "since %q", s)
		assert.Zero(t, got, "since %q", s)
	}
	tampered := []byte(l.encode(2))
	tampered[len(tampered)-3] ^= 1
	for name, s := range map[string]string{
		"another log's seq":     other.encode(2),
		"a seq not handed out":  l.encode(4),
		"plain integer":         "2",
		"garbage":               "garbage",
		"now":                   "now",
		"number changed":        "1" + l.encode(2)[1:],
		"leading zero":          "0" + l.encode(2),
		"payload tampered":      string(tampered),
		"CouchDB's seq":         "3-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXOBAuzJaeapSYZp2DTgMSaPBUgyNACp_yDTEhmyAHQTIMY",
		"marker without number": "-g1AAAA",
	} {
		_, ok := l.parse(s)
		assert.False(t, ok, "%s: %s", name, s)
	}
}

func TestUpdatesLogKeepsOneRowPerTypeAndDBInWriteOrder(t *testing.T) {
	t.Parallel()
	l := newUpdatesLog(time.Hour)
	t.Cleanup(l.close)
	l.record("a", updateCreated)
	l.record("a", updateUpdated)
	l.record("b", updateCreated)
	l.record("a", updateUpdated)
	rows, last, _ := l.read(0, -1)
	assert.Empty(t, rows, "rows wait for the window")
	assert.Zero(t, last)

	l.flush()
	rows, last, changed := l.read(0, -1)
	assert.Equal(t, []updateRow{
		{updateKey{"a", updateCreated}, 1},
		{updateKey{"b", updateCreated}, 2},
		{updateKey{"a", updateUpdated}, 3},
	}, rows)
	assert.Equal(t, uint64(3), last)

	l.record("a", updateDeleted)
	l.record("a", updateCreated)
	l.flush()
	select {
	case <-changed:
	default:
		t.Fatal("flush did not signal the change")
	}
	rows, last, _ = l.read(2, -1)
	assert.Equal(t, []updateRow{
		{updateKey{"a", updateUpdated}, 3},
		{updateKey{"a", updateDeleted}, 4},
		{updateKey{"a", updateCreated}, 5},
	}, rows, "a re-created db ends with created")
	assert.Equal(t, uint64(5), last)

	rows, last, _ = l.read(0, 2)
	assert.Len(t, rows, 2)
	assert.Equal(t, uint64(3), last, "a limited read ends at its last row")
	rows, last, _ = l.read(3, 0)
	assert.Empty(t, rows)
	assert.Equal(t, uint64(3), last, "limit=0 stays at since")
}

func TestUpdatesLogHoldKeepsRowsUntilRelease(t *testing.T) {
	t.Parallel()
	l := newUpdatesLog(0) // rows get seqs at once, unless held
	t.Cleanup(l.close)
	l.record("a", updateUpdated)
	l.hold()
	l.record("b", updateUpdated)
	l.record("c", updateUpdated)
	rows, last, changed := l.read(0, -1)
	assert.Equal(t, []updateRow{{updateKey{"a", updateUpdated}, 1}}, rows, "held rows are not in the feed")
	assert.Equal(t, uint64(1), last)

	l.release()
	select {
	case <-changed:
	default:
		t.Fatal("release did not signal the change")
	}
	rows, last, _ = l.read(1, -1)
	assert.Equal(t, []updateRow{{updateKey{"b", updateUpdated}, 2}, {updateKey{"c", updateUpdated}, 3}}, rows)
	assert.Equal(t, uint64(3), last)
	l.record("d", updateUpdated)
	_, last, _ = l.read(3, -1)
	assert.Equal(t, uint64(4), last, "after release, rows get seqs as before")
}

func TestClassifyWrite(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		method, path string
		want         dbWrite
		ok           bool
	}{
		{"PUT", "/db", dbWrite{"db", updateCreated}, true},
		{"PUT", "/db/", dbWrite{"db", updateCreated}, true},
		{"DELETE", "/db", dbWrite{"db", updateDeleted}, true},
		{"POST", "/db", dbWrite{"db", updateUpdated}, true},
		{"PUT", "/a%2Fb%2Bc", dbWrite{"a/b+c", updateCreated}, true},
		{"PUT", "/a+b", dbWrite{"a+b", updateCreated}, true},
		{"PUT", "/_users", dbWrite{"_users", updateCreated}, true},
		{"PUT", "/db/doc", dbWrite{"db", updateUpdated}, true},
		{"DELETE", "/db/doc", dbWrite{"db", updateUpdated}, true},
		{"COPY", "/db/doc", dbWrite{"db", updateUpdated}, true},
		{"PUT", "/db/doc/att.txt", dbWrite{"db", updateUpdated}, true},
		{"POST", "/db/_bulk_docs", dbWrite{"db", updateUpdated}, true},
		{"POST", "/db/_purge", dbWrite{"db", updateUpdated}, true},
		{"POST", "/db/_index", dbWrite{"db", updateUpdated}, true},
		{"PUT", "/db/_design/x", dbWrite{"db", updateUpdated}, true},
		{"PUT", "/db/_design%2Fx", dbWrite{"db", updateUpdated}, true},
		{"PUT", "/db/_design/x/att", dbWrite{"db", updateUpdated}, true},
		{"POST", "/db/_design/x/_update/f/doc", dbWrite{"db", updateUpdated}, true},
		{"POST", "/db/_design/x/_view/v", dbWrite{}, false},
		{"PUT", "/db/_local/x", dbWrite{}, false},
		{"PUT", "/db/_local%2Fx", dbWrite{}, false},
		{"DELETE", "/db/_local/x", dbWrite{}, false},
		{"PUT", "/db/_security", dbWrite{}, false},
		{"POST", "/db/_all_docs", dbWrite{}, false},
		{"POST", "/db/_find", dbWrite{}, false},
		{"POST", "/db/_bulk_get", dbWrite{}, false},
		{"POST", "/db/_revs_diff", dbWrite{}, false},
		{"POST", "/db/_compact", dbWrite{}, false},
		{"GET", "/db/doc", dbWrite{}, false},
		{"HEAD", "/db", dbWrite{}, false},
		{"COPY", "/db", dbWrite{}, false},
		{"DELETE", "/_session", dbWrite{}, false},
		{"POST", "/_replicate", dbWrite{}, false},
		{"PUT", "/_config/x/y", dbWrite{}, false},
		{"PUT", "/", dbWrite{}, false},
		{"PUT", "/%zz", dbWrite{}, false},
	} {
		got, ok := classifyWrite(tc.method, tc.path)
		assert.Equal(t, tc.ok, ok, "%s %s", tc.method, tc.path)
		assert.Equal(t, tc.want, got, "%s %s", tc.method, tc.path)
	}
}

func FuzzUpdatesLogParse(f *testing.F) {
	l := newUpdatesLog(0)
	f.Cleanup(l.close)
	for i := range 5 {
		l.record("db"+strconv.Itoa(i), updateUpdated)
	}
	for _, s := range []string{"", "0", "now", l.encode(3), l.encode(5), "5-g1AAAA", "x-y"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, ok := l.parse(s)
		if !ok {
			return
		}
		if s != "" && s != "0" && l.encode(n) != s {
			t.Fatalf("parse(%q) = %d, which encodes as %q", s, n, l.encode(n))
		}
		if n > l.last() {
			t.Fatalf("parse(%q) = %d, after the last seq %d", s, n, l.last())
		}
	})
}
