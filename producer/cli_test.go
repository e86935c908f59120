package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// clearConfig unsets every SPIEGEL_* variable for the test, so that it shows what happens
// before any configuration is required.
func clearConfig(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "SPIEGEL_") {
			t.Setenv(name, "")
			require.NoError(t, os.Unsetenv(name))
		}
	}
}

// A bad command line is named in the words of the other CLIs and exits 2 before any
// configuration is required; help and version need none either.
func TestCommandLine(t *testing.T) {
	clearConfig(t)
	cases := []struct {
		args     []string
		code     int
		stdout   string // must contain
		stderr   string // must contain
		noStdout string // must not contain
	}{
		{[]string{"--bogus"}, 2, "", "producer: unknown flag --bogus", ""},
		{[]string{"-x=1"}, 2, "", "unknown flag --x", ""},
		{[]string{"frob"}, 2, "", "producer: unknown command frob", ""},
		{[]string{"frob", "--help"}, 2, "", "unknown command frob", ""},
		{[]string{"install", "--bogus"}, 2, "", "producer install: unknown flag --bogus", ""},
		{[]string{"install", "extra"}, 2, "", `unexpected arguments ["extra"]`, ""},
		{[]string{"uninstall", "--yes", "--bogus"}, 2, "", "unknown flag --bogus", ""},
		{[]string{"resync", "--db"}, 2, "", "flag --db needs a value", ""},
		{[]string{"resync", "--db", "("}, 2, "", `--db "("`, ""},
		{[]string{"replay"}, 2, "", "--rule is required", ""},
		{[]string{"replay", "--rule", "r", "--wait", "soon"}, 2, "", `invalid value "soon" for flag --wait`, ""},
		{[]string{"status", "--check=maybe"}, 2, "", "invalid boolean value", ""},
		{[]string{"status", "--timeout"}, 2, "", "--timeout needs a duration", ""},
		{[]string{"deadletters"}, 2, "", "want a subcommand", ""},
		{[]string{"deadletters", "frob"}, 2, "", `unknown command "frob"`, ""},
		{[]string{"deadletters", "list", "--group", "x"}, 2, "", `--group "x"`, ""},
		{[]string{"deadletters", "purge", "--bogus"}, 2, "", "unknown flag --bogus", ""},
		{[]string{"help", "frob"}, 2, "", "unknown command frob", ""},
		{[]string{"version", "--bogus"}, 2, "", "unknown flag --bogus", ""},
		{[]string{"install"}, 2, "", "SPIEGEL_COUCHDB_URL is required", ""}, // a good command line needs the configuration
		{[]string{"version"}, 0, "producer ", "", ""},
		{[]string{"--version"}, 0, "go1.", "", ""},
		{[]string{"status", "--version"}, 0, "producer ", "", ""},
		{[]string{"help"}, 0, "Environment:", "", "SPIEGEL_PUBLISH_MAX_INFLIGHT"},
		{[]string{"--help"}, 0, "SPIEGEL_COUCHDB_URL", "", "SPIEGEL_POSITION_SAVE_INTERVAL"},
		{[]string{"--help-all"}, 0, "SPIEGEL_POSITION_SAVE_INTERVAL", "", "left out"},
		{[]string{"help", "status"}, 0, "--check", "", "SPIEGEL_HOT_FEEDS"},
		{[]string{"install", "--help"}, 0, "--update", "", "SPIEGEL_HOT_FEEDS"},
		{[]string{"install", "--help-all"}, 0, "SPIEGEL_HOT_FEEDS", "", ""},
		{[]string{"deadletters", "list", "--help"}, 0, "--limit N (default 50)", "", "Environment:"},
		{[]string{"replay", "--help"}, 0, "--wait DURATION (default 10m0s)", "", "Environment:"},
		{[]string{"rules", "--help"}, 0, "validate FILE...", "", ""},
	}
	for _, c := range cases {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := realMain(t.Context(), c.args, strings.NewReader(""), &stdout, &stderr)
			assert.Equal(t, c.code, code, "stdout %s\nstderr %s", stdout.String(), stderr.String())
			assert.Contains(t, stdout.String(), c.stdout)
			assert.Contains(t, stderr.String(), c.stderr)
			if c.noStdout != "" {
				assert.NotContains(t, stdout.String(), c.noStdout)
			}
		})
	}
}

// `version --json` names the build: version, dirty flag and Go version at least.
func TestVersionJSON(t *testing.T) {
	var stdout bytes.Buffer
	require.Equal(t, 0, realMain(t.Context(), []string{"version", "--json"}, nil, &stdout, &bytes.Buffer{}))
	var v map[string]any
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &v))
	assert.Equal(t, "producer", v["name"])
	assert.NotEmpty(t, v["version"])
	assert.Contains(t, v["go_version"], "go1.")
	assert.Contains(t, v, "dirty")
}

// Every help a command prints keeps its lines within 100 characters, and each admin command's
// help lists its own flags, --timeout, and the variables it reads, not the environment table.
func TestCommandHelp(t *testing.T) {
	clearConfig(t)
	for name, c := range cliCommands {
		for _, all := range []bool{false, true} {
			var out bytes.Buffer
			printHelp(&out, name, all)
			for _, l := range strings.Split(out.String(), "\n") {
				assert.LessOrEqual(t, len([]rune(l)), 100, "%s: %s", name, l)
			}
			assert.Contains(t, out.String(), "producer "+name+" "+c.synopsis)
			assert.Contains(t, out.String(), "--timeout DURATION")
			assert.Contains(t, out.String(), "SPIEGEL_COUCHDB_URL")
			assert.Equal(t, all, strings.Contains(out.String(), "Environment:"), name)
		}
	}
	for _, all := range []bool{false, true} {
		var out bytes.Buffer
		printHelp(&out, "", all)
		for _, l := range strings.Split(out.String(), "\n") {
			assert.LessOrEqual(t, len([]rune(l)), 100, l)
		}
	}
	// Each admin command that reports something offers --json.
	for _, name := range []string{"install", "uninstall", "resync", "replay", "status", "deadletters"} {
		var out bytes.Buffer
		printHelp(&out, name, false)
		assert.Contains(t, out.String(), "  --json\n", name)
	}
}

// An unknown SPIEGEL_* variable is warned about by an admin command, with a suggestion, before it
// reaches the servers; the warning names the level warn.
func TestUnknownVariableWarned(t *testing.T) {
	clearConfig(t)
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:1")
	t.Setenv("SPIEGEL_ADMIN_TIMEOUT", "1s")
	t.Setenv("SPIEGEL_LOG_FORMAT", "json")
	t.Setenv("SPIEGEL_ACKWAIT", "1s")
	ctx, cancel := context.WithCancel(t.Context())
	cancel() // the command fails at once: only the warning matters here
	var stdout, stderr bytes.Buffer
	code := realMain(ctx, []string{"resync"}, strings.NewReader(""), &stdout, &stderr)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr.String(), `"level":"warn"`)
	assert.Contains(t, stderr.String(), "unknown variable SPIEGEL_ACKWAIT ignored: did you mean SPIEGEL_ACK_WAIT?")
}

// The steps of install and uninstall become JSON objects; done follows the final line and err.
func TestPrintSteps(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	require.NoError(t, printSteps(&out, "spiegel db \"spiegel\": present\nsecurity: admins only\ninstall complete\n", "install complete", nil))
	var rep stepsReport
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
	assert.True(t, rep.Done)
	assert.Equal(t, []step{{Object: `spiegel db "spiegel"`, Result: "present"}, {Object: "security", Result: "admins only"}}, rep.Steps)

	out.Reset()
	err := printSteps(&out, "security: admins only\n", "install complete", assert.AnError)
	require.ErrorIs(t, err, assert.AnError)
	rep = stepsReport{}
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
	assert.False(t, rep.Done)
	assert.Equal(t, assert.AnError.Error(), rep.Error)
}
