package main

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// `producer install` keeps a stream edited by hand and names the difference; `--update` applies
// the default back and says so. The configured retention and bound reach what install creates.
func TestInstallKeepsEditsUntilUpdate(t *testing.T) {
	e := newEnv(t) // installs once
	e.cfg.ChangesMaxAge = 7 * 24 * time.Hour
	changes, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	cfg := changes.CachedInfo().Config
	cfg.MaxAge = 30 * 24 * time.Hour // nats stream edit SPIEGEL_CHANGES --max-age 30d
	_, err = e.JS.UpdateStream(t.Context(), cfg)
	require.NoError(t, err)

	out := e.run(t, "install")
	assert.Contains(t, out, "stream SPIEGEL_CHANGES: max_age is 720h0m0s, default 168h0m0s (kept; --update applies it)\n")
	assert.Contains(t, out, "install complete")
	changes, err = e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	assert.Equal(t, 30*24*time.Hour, changes.CachedInfo().Config.MaxAge, "install kept the edit")

	out = e.run(t, "install", "--update")
	assert.Contains(t, out, "stream SPIEGEL_CHANGES: max_age was 720h0m0s, now 168h0m0s (updated)\n")
	changes, err = e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	assert.Equal(t, 7*24*time.Hour, changes.CachedInfo().Config.MaxAge, "--update applied the default")
}

// SPIEGEL_CHANGES_MAX_AGE, SPIEGEL_DEADLETTER_MAX_AGE and SPIEGEL_MAX_ACK_PENDING reach the
// streams and consumers install creates; bad values are refused naming the variable.
func TestInstallSettingsReachWhatItCreates(t *testing.T) {
	e := newEnv(t)
	require.NoError(t, e.JS.DeleteStream(t.Context(), "SPIEGEL_CHANGES"))
	require.NoError(t, e.JS.DeleteStream(t.Context(), "SPIEGEL_DEADLETTER"))
	for _, g := range events.Groups {
		require.NoError(t, e.JS.DeleteConsumer(t.Context(), "SPIEGEL_WORK", g.ConsumerName()))
	}
	e.cfg.ChangesMaxAge, e.cfg.DeadLetterMaxAge, e.cfg.MaxAckPending = 36*time.Hour, 0, 64

	out := e.run(t, "install")
	assert.Contains(t, out, "stream SPIEGEL_CHANGES: created\n")
	changes, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	assert.Equal(t, 36*time.Hour, changes.CachedInfo().Config.MaxAge)
	dl, err := e.JS.Stream(t.Context(), "SPIEGEL_DEADLETTER")
	require.NoError(t, err)
	assert.Equal(t, time.Duration(0), dl.CachedInfo().Config.MaxAge, "0: dead letters kept forever")
	for _, g := range events.Groups {
		c, err := e.JS.Consumer(t.Context(), "SPIEGEL_WORK", g.ConsumerName())
		require.NoError(t, err)
		assert.Equal(t, 64, c.CachedInfo().Config.MaxAckPending, g)
	}

	for name, value := range map[string]string{"SPIEGEL_CHANGES_MAX_AGE": "-1h", "SPIEGEL_DEADLETTER_MAX_AGE": "-1s", "SPIEGEL_MAX_ACK_PENDING": "-5"} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("SPIEGEL_COUCHDB_URL", e.cfg.CouchDBURL)
			t.Setenv(name, value)
			var stdout, stderr bytes.Buffer
			code := realMain(t.Context(), []string{"install"}, nil, &stdout, &stderr)
			assert.Equal(t, 2, code)
			assert.Contains(t, stderr.String(), name+"=")
		})
	}
}

// install's --help names --update and the variables that set what it creates; an unknown flag is
// a usage error.
func TestInstallHelpAndFlags(t *testing.T) {
	var stdout, stderr bytes.Buffer
	require.Equal(t, 0, realMain(t.Context(), []string{"install", "--help"}, nil, &stdout, &stderr))
	for _, want := range []string{"--update", "SPIEGEL_CHANGES_MAX_AGE", "SPIEGEL_DEADLETTER_MAX_AGE", "SPIEGEL_MAX_ACK_PENDING"} {
		assert.Contains(t, stdout.String(), want)
	}
	err := runInstall(t.Context(), nil, discardLogger(), cmdIO{args: []string{"--upgrade"}, stdout: &stdout, stderr: &stderr})
	var uerr usageError
	require.ErrorAs(t, err, &uerr)
}
