package main

import (
	"context"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// closedPort is a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// TestAdminCommandsFailFast runs every admin command with a wrong CouchDB password and a NATS
// URL nobody listens on: each gives up within its --timeout and names both problems in plain
// sentences — which server, at which URL, what it answered — without the password.
func TestAdminCommandsFailFast(t *testing.T) {
	server := couchtest.Get(t)
	u, err := url.Parse(server.URL)
	require.NoError(t, err)
	u.User = url.UserPassword("spiegel_nobody", "wrong-Secret-42")
	natsAddr := closedPort(t)
	t.Setenv("SPIEGEL_COUCHDB_URL", u.String())
	t.Setenv("SPIEGEL_NATS_URL", "nats://"+natsAddr)
	t.Setenv("SPIEGEL_HTTP_ADDR", "")

	for _, args := range [][]string{
		{"install", "--timeout", "2s"},
		{"status", "--timeout=2s"},
		{"uninstall", "--yes", "--timeout", "2s"},
		{"resync", "--timeout", "2s"},
		{"replay", "--rule", "r1", "--timeout", "2s"},
	} {
		t.Run(args[0], func(t *testing.T) {
			var stdout, stderr strings.Builder
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			start := time.Now()
			code := realMain(ctx, args, strings.NewReader(""), &stdout, &stderr)
			took := time.Since(start)
			out := stderr.String()
			assert.Equal(t, 1, code, out)
			assert.Less(t, took, 10*time.Second, "gave up after its 2s timeout, not when the test did")
			assert.NotContains(t, out, "wrong-Secret-42")
			assert.NotContains(t, stdout.String(), "wrong-Secret-42")
			assert.NotContains(t, out, `"level"`, "plain sentences, not JSON log lines")
			lines := strings.Split(strings.TrimSpace(out), "\n")
			require.Len(t, lines, 2, out)
			assert.Contains(t, lines[0], "producer "+args[0]+": CouchDB at ")
			assert.Contains(t, lines[0], "refused the credentials (user spiegel_nobody): 401")
			assert.Contains(t, lines[1], "producer "+args[0]+": NATS at nats://"+natsAddr+" ")
		})
	}
}

// TestAdminCommandUnreachableCouchDB: a CouchDB nobody listens on is named as unreachable, with
// the reason the system gave.
func TestAdminCommandUnreachableCouchDB(t *testing.T) {
	e := newEnv(t)
	couchAddr := closedPort(t)
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://admin:Pw-77-secret@"+couchAddr)
	t.Setenv("SPIEGEL_NATS_URL", e.cfg.NATSURL)
	t.Setenv("SPIEGEL_SUBJECT_PREFIX", e.cfg.SubjectPrefix)
	t.Setenv("SPIEGEL_DB_NAME", e.cfg.DBName)
	t.Setenv("SPIEGEL_HTTP_ADDR", "")
	t.Setenv("SPIEGEL_ADMIN_TIMEOUT", "3s")
	var stderr strings.Builder
	code := realMain(t.Context(), []string{"status"}, strings.NewReader(""), &strings.Builder{}, &stderr)
	assert.Equal(t, 1, code)
	out := stderr.String()
	assert.Equal(t, 1, strings.Count(out, "\n"), "one problem, one line: %s", out)
	assert.Contains(t, out, "producer status: CouchDB at http://admin:xxxxx@"+couchAddr+" is not reachable: ")
	assert.Contains(t, out, "connection refused")
	assert.NotContains(t, out, "Pw-77-secret")
}

// TestAdminCommandInterrupted: a signal while the checks wait ends the command with
// "interrupted", not with what the cut-short checks saw.
func TestAdminCommandInterrupted(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", couchtest.Get(t).URL)
	t.Setenv("SPIEGEL_NATS_URL", "nats://"+closedPort(t))
	t.Setenv("SPIEGEL_HTTP_ADDR", "")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	time.AfterFunc(500*time.Millisecond, cancel) // the operator's Ctrl-C
	var stderr strings.Builder
	code := realMain(ctx, []string{"status", "--timeout", "1m"}, strings.NewReader(""), &strings.Builder{}, &stderr)
	assert.Equal(t, 1, code)
	assert.Equal(t, "producer status: interrupted\n", stderr.String())
}

func TestTimeoutFlag(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		rest    []string
		timeout time.Duration
		err     string
	}{
		{args: nil},
		{args: []string{"--json"}, rest: []string{"--json"}},
		{args: []string{"--timeout", "3s", "--json"}, rest: []string{"--json"}, timeout: 3 * time.Second},
		{args: []string{"--rule", "r", "-timeout=1m"}, rest: []string{"--rule", "r"}, timeout: time.Minute},
		{args: []string{"--timeout"}, err: "--timeout needs a duration"},
		{args: []string{"--timeout", "soon"}, err: `--timeout "soon": want a positive duration`},
		{args: []string{"--timeout=0s"}, err: "want a positive duration"},
		{args: []string{"--timeouts", "x"}, rest: []string{"--timeouts", "x"}},
	} {
		rest, timeout, err := timeoutFlag(tc.args)
		if tc.err != "" {
			assert.ErrorContains(t, err, tc.err, tc.args)
			continue
		}
		require.NoError(t, err, tc.args)
		assert.Equal(t, tc.rest, rest, tc.args)
		assert.Equal(t, tc.timeout, timeout, tc.args)
	}
}

// TestAdminTimeoutFlagRejected: a bad --timeout is a usage error (exit 2) before any server is
// asked.
func TestAdminTimeoutFlagRejected(t *testing.T) {
	var stderr strings.Builder
	code := realMain(t.Context(), []string{"status", "--timeout", "-3s"}, strings.NewReader(""), &strings.Builder{}, &stderr)
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr.String(), `producer status: --timeout "-3s": want a positive duration`)
}
