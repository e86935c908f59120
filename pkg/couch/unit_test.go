package couch

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSeqUnmarshal(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in      string
		want    Seq
		wantErr bool
	}{
		{`"12-g1AAAA"`, "12-g1AAAA", false},
		{`3`, "3", false},
		{`0`, "0", false},
		{`12345678901234567890123`, "12345678901234567890123", false}, // no float rounding
		{`1.5e3`, "1.5e3", false},
		{`null`, "", false},
		{`[1, "abc"]`, `[1,"abc"]`, false},
		{`""`, "", false},
		{`true`, "", true},
		{`{"a":`, "", true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			t.Parallel()
			var s Seq
			err := json.Unmarshal([]byte(tt.in), &s)
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, s)
		})
	}
	var row struct {
		Seq Seq `json:"seq"`
	}
	require.NoError(t, json.Unmarshal([]byte(`{"seq":42}`), &row))
	assert.Equal(t, "42", row.Seq.String())
}

func TestReadLines(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 300)
	tests := []struct {
		name     string
		in       string
		max      int
		want     []string
		wantLong int
	}{
		{"heartbeats and CRLF", "\n\na\r\n\n b \nc", 100, []string{"a", "b", "c"}, 0},
		{"empty", "", 100, nil, 0},
		{"too long line skipped", "a\n" + long + "\nb\n", 100, []string{"a", "b"}, 1},
		{"too long final line skipped", "a\n" + long, 100, []string{"a"}, 1},
		{"longer than the read buffer", strings.Repeat("y", 200<<10) + "\nz\n", 1 << 20, []string{strings.Repeat("y", 200<<10), "z"}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var got []string
			long := 0
			err := readLines(strings.NewReader(tt.in), tt.max, func(l []byte) error {
				got = append(got, string(l))
				return nil
			}, func() { long++ })
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.wantLong, long)
		})
	}
	stop := errors.New("stop")
	err := readLines(strings.NewReader("a\nb\n"), 100, func([]byte) error { return stop }, nil)
	assert.Same(t, stop, err)
}

func TestDiff(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		prev, next Snapshot
		want       []DBEvent
	}{
		{"nil to nil", nil, nil, nil},
		{"no change", Snapshot{"a": "1"}, Snapshot{"a": "1"}, nil},
		{"all kinds, sorted", Snapshot{"b": "1", "c": "2", "d": "3"}, Snapshot{"a": "0", "c": "2-x", "d": "3"},
			[]DBEvent{{DB: "a", Type: "created"}, {DB: "b", Type: "deleted"}, {DB: "c", Type: "updated"}}},
		{"from nothing", nil, Snapshot{"z": "1", "y": "1"}, []DBEvent{{DB: "y", Type: "created"}, {DB: "z", Type: "created"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			assert.Equal(t, tt.want, Diff(tt.prev, tt.next))
		})
	}
}

func TestParseLines(t *testing.T) {
	t.Parallel()
	ev, seq, ok, err := parseGlobalChangesLine([]byte(`{"seq":"9-x","id":"deleted:a:b","changes":[]}`))
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, DBEvent{DB: "a:b", Type: "deleted", Seq: "9-x"}, ev, "split at the first ':'")
	assert.Equal(t, "9-x", seq)
	for _, bad := range []string{`{"seq":"1","id":"nocolon"}`, `{"seq":"1","id":":db"}`, `{"seq":"1","id":"created:"}`, `{}`} {
		_, _, _, err := parseGlobalChangesLine([]byte(bad))
		assert.Error(t, err, bad)
	}
	_, seq, ok, err = parseGlobalChangesLine([]byte(`{"seq":"2","id":"_design/x"}`))
	require.NoError(t, err)
	assert.False(t, ok)
	assert.Equal(t, "2", seq)
	_, seq, ok, err = parseChangeLine([]byte(`{"last_seq":17,"pending":0}`))
	require.NoError(t, err)
	assert.False(t, ok)
	assert.Equal(t, "17", seq)
	_, _, _, err = parseChangeLine([]byte(`{"id":"x","changes":[]}`))
	assert.Error(t, err, "a change without seq is malformed")
	var fe *feedLineError
	_, _, _, err = parseChangeLine([]byte(`{"error":"unknown_error","reason":"bad"}`))
	require.ErrorAs(t, err, &fe)
}

// closedPortURL returns a base URL with a password on a port nothing listens on.
func closedPortURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return "http://admin:SECRETPW@" + addr
}

func TestErrorsAndLogsNeverHoldThePassword(t *testing.T) {
	t.Parallel()
	c, logs := newTestClient(t, closedPortURL(t))
	ctx := t.Context()
	var errs []error
	errs = append(errs, c.Do(ctx, "GET", "/", nil, nil, nil))
	_, err := c.Server(ctx)
	errs = append(errs, err)
	_, err = c.DBInfo(ctx, "db")
	errs = append(errs, err)
	_, err = c.DBInfos(ctx, []string{"a", "b"})
	errs = append(errs, err)
	_, err = c.AllDBs(ctx, "", 10)
	errs = append(errs, err)
	_, err = c.Changes(ctx, "db", ChangesOptions{})
	errs = append(errs, err)
	_, err = c.TakeSnapshot(ctx, nil)
	errs = append(errs, err)
	_, err = c.NewUpdatesFeed(ctx, SourceAuto, FeedOptions{})
	errs = append(errs, err)
	for _, source := range []string{SourceDBUpdates, SourceGlobalChanges, SourcePoll} {
		feed, ferr := c.NewUpdatesFeed(ctx, source, FeedOptions{})
		require.NoError(t, ferr)
		fctx, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
		errs = append(errs, feed.Run(fctx, SinceNow, func(DBEvent) error { return nil }))
		cancel()
	}
	fctx, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
	errs = append(errs, c.FollowChanges(fctx, "db", ChangesOptions{}, func(Change) error { return nil }))
	cancel()
	for i, err := range errs {
		require.Error(t, err, "call %d", i)
		assert.NotContains(t, err.Error(), "SECRETPW", "call %d", i)
	}
	assert.Contains(t, logs.String(), "reconnecting", "the feeds logged their retries")
	assert.NotContains(t, logs.String(), "SECRETPW")
	assert.Contains(t, c.Redacted(), "xxxxx")
}
