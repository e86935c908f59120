package config

import (
	"bytes"
	"encoding/json"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// An unknown SPIEGEL_* variable is warned about with the nearest name of the binary; the names of
// the other binaries, of the tools and of other programs are not.
func TestCheckEnv(t *testing.T) {
	t.Parallel()
	cases := []struct {
		spec any
		env  string
		want string // "": no warning
	}{
		{&Producer{}, "SPIEGEL_ACKWAIT=1s", "unknown variable SPIEGEL_ACKWAIT ignored: did you mean SPIEGEL_ACK_WAIT?"},
		{&OnChange{}, "SPIEGEL_CONCURENCY=5", "unknown variable SPIEGEL_CONCURENCY ignored: did you mean SPIEGEL_CONCURRENCY?"},
		{&Producer{}, "SPIEGEL_SOURSE=poll", "unknown variable SPIEGEL_SOURSE ignored: did you mean SPIEGEL_SOURCE?"},
		{&Producer{}, "SPIEGEL_FROBNICATE=1", "unknown variable SPIEGEL_FROBNICATE ignored"},
		{&Producer{}, "SPIEGEL_CONCURRENCY=5", ""},       // the consumers' variable
		{&Replicator{}, "SPIEGEL_SWEEP_INTERVAL=1m", ""}, // the producer's
		{&OnChange{}, "SPIEGEL_TEST_AS_ONCHANGE=1", ""},  // the tests'
		{&OnChange{}, "SPIEGEL_REQUIRE_COUCHDB=1", ""},   // the tests'
		{&Producer{}, "COUCHDB_URL=http://x", ""},        // not ours
		{&Producer{}, "SPIEGEL_ACK_WAIT=1s", ""},         // known
		{&OnChange{}, "SPIEGEL_WEBHOOK_SIGNATURE_SECRET=a", "SPIEGEL_WEBHOOK_SIGNATURE_SECRET is deprecated: use SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES"},
	}
	for _, c := range cases {
		t.Run(c.env, func(t *testing.T) {
			t.Parallel()
			ws := CheckEnv(c.spec, []string{"PATH=/bin", c.env})
			if c.want == "" {
				assert.Empty(t, ws)
				return
			}
			require.Len(t, ws, 1)
			assert.Equal(t, c.want, ws[0].String())
		})
	}
}

// The old name of a renamed variable still configures it; the new name wins when both are set.
func TestDeprecatedNames(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:5984")
	t.Setenv("SPIEGEL_WEBHOOK_SIGNATURE_SECRET", "old_a, old_b")
	var o OnChange
	require.NoError(t, Load(&o))
	assert.Equal(t, []string{"old_a", "old_b"}, o.SignatureSecrets)

	t.Setenv("SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES", "new")
	o = OnChange{}
	require.NoError(t, Load(&o))
	assert.Equal(t, []string{"new"}, o.SignatureSecrets)
	assert.Contains(t, Reference(), "| `SPIEGEL_WEBHOOK_SIGNATURE_SECRET` | `SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES` |")
}

// The start-up line names the build and the effective configuration, and no secret set in the
// configuration appears in it, in either log format.
func TestLogStartHidesSecrets(t *testing.T) {
	secrets := []string{"c0uchPw", "n4tsPw", "t0ken-xyz", "urlT0ken", "n4tsUrlPw"}
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://admin:c0uchPw@couch-a:5984,https://admin:c0uchPw@couch-b:6984/")
	t.Setenv("SPIEGEL_NATS_URL", "nats://urlT0ken@nats-a:4222, nats://u:n4tsUrlPw@nats-b:4222")
	t.Setenv("SPIEGEL_NATS_PASSWORD", "n4tsPw")
	t.Setenv("SPIEGEL_NATS_TOKEN", "t0ken-xyz")
	t.Setenv("SPIEGEL_NATS_USER", "spiegel")
	t.Setenv("SPIEGEL_ACKWAIT", "5s")
	for _, spec := range []interface{ Validate() error }{&Producer{}, &Replicator{}, &OnChange{}} {
		require.NoError(t, Load(spec))
		for _, format := range []string{"json", "text"} {
			var buf bytes.Buffer
			log, err := logging.New("info", format, &buf)
			require.NoError(t, err)
			LogStart(log, "x", spec, []string{"SPIEGEL_ACKWAIT=5s"})
			out := buf.String()
			lines := strings.Split(strings.TrimSpace(out), "\n")
			require.Len(t, lines, 2, out)
			for _, s := range secrets {
				assert.NotContains(t, out, s, format)
			}
			assert.Contains(t, lines[0], "couch-a:5984", "the URLs are logged without their credentials")
			assert.Contains(t, lines[0], "nats-b:4222")
			assert.Contains(t, lines[0], "SPIEGEL_ACK_WAIT")
			assert.Contains(t, lines[1], "did you mean SPIEGEL_ACK_WAIT?")
			if format == "json" {
				var line map[string]any
				require.NoError(t, json.Unmarshal([]byte(lines[0]), &line))
				assert.Equal(t, "info", line["level"])
				assert.NotEmpty(t, line["version"])
				assert.NotEmpty(t, line["go_version"])
				cfg, _ := line["config"].(map[string]any)
				assert.Equal(t, "xxxxx", cfg["SPIEGEL_NATS_PASSWORD"])
				assert.Equal(t, "spiegel", cfg["SPIEGEL_NATS_USER"])
				assert.Equal(t, "nats://xxxxx@nats-a:4222,nats://u:xxxxx@nats-b:4222", cfg["SPIEGEL_NATS_URL"])
			}
		}
	}
}

// Every variable whose name says it holds a secret is marked secret, so that Effective hides it.
func TestSecretVariablesAreMarked(t *testing.T) {
	t.Parallel()
	for _, spec := range []any{&Producer{}, &Replicator{}, &OnChange{}} {
		for _, v := range Vars(spec) {
			if v.Deprecated != "" {
				continue // read into the new name's field
			}
			secretName := (strings.Contains(v.Name, "PASSWORD") || strings.Contains(v.Name, "TOKEN") ||
				strings.Contains(v.Name, "SECRET")) && !strings.HasSuffix(v.Name, "_FILE") && !strings.HasSuffix(v.Name, "_NAMES")
			assert.Equal(t, secretName, v.Secret, v.Name)
		}
	}
}

func TestRedactURLs(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"http://a:pw@h:5984":              "http://a:xxxxx@h:5984",
		"nats://tok@h:4222":               "nats://xxxxx@h:4222",
		"http://a:p@ss@h:1,http://h2":     "http://a:xxxxx@h:1,http://h2",
		"http://h/x@y":                    "xxxxx",
		"http://u:p%zz@h/":                "http://u:xxxxx@h/",
		"http://h:5984":                   "http://h:5984",
		"nats://a:b@h1:4222, nats://c@h2": "nats://a:xxxxx@h1:4222,nats://xxxxx@h2",
	} {
		assert.Equal(t, want, redactURLs(in), in)
	}
}

// The build comes from the Go build info; the Makefile's -ldflags version wins.
func TestBuildOf(t *testing.T) {
	t.Parallel()
	bi := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Version: "v1.2.3"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.time", Value: "2026-01-02T03:04:05Z"},
		{Key: "vcs.modified", Value: "true"}}}
	cases := []struct {
		ldflags string
		bi      *debug.BuildInfo
		want    string
	}{
		{"dev", bi, "v1.2.3 (commit 0123456789ab, 2026-01-02T03:04:05Z, dirty) go1.99.1"},
		{"v2.0.0", bi, "v2.0.0 (commit 0123456789ab, 2026-01-02T03:04:05Z, dirty) go1.99.1"},
		{"dev", &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Version: "(devel)"}}, "dev go1.99.1"},
	}
	for _, c := range cases {
		assert.Equal(t, c.want, buildOf(c.ldflags, c.bi, true).String())
	}
	assert.Equal(t, "dev", buildOf("dev", nil, false).Version)
}

// A consumer's command line: help, version, unknown flags and commands (exit 2, named, before any
// configuration is read); no argument and healthcheck are left to consumer.Main.
func TestConsumerFront(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "") // not needed by any of these
	cases := []struct {
		args     []string
		code     int
		done     bool
		out, err string
		notInOut string
	}{
		{nil, 0, false, "", "", ""},
		{[]string{"healthcheck"}, 0, false, "", "", ""},
		{[]string{"--bogus"}, 2, true, "", "onchange: unknown flag --bogus", ""},
		{[]string{"--bogus=1"}, 2, true, "", "unknown flag --bogus", ""},
		{[]string{"frob"}, 2, true, "", "onchange: unknown command frob", ""},
		{[]string{"version"}, 0, true, "onchange ", "", ""},
		{[]string{"--version"}, 0, true, "go1.", "", ""},
		{[]string{"version", "--json"}, 0, true, `"go_version":`, "", ""},
		{[]string{"version", "--bogus"}, 2, true, "", "unknown flag --bogus", ""},
		{[]string{"--help"}, 0, true, "SPIEGEL_WEBHOOK_TIMEOUT", "", "SPIEGEL_RETRY_MAX"},
		{[]string{"help"}, 0, true, "Webhooks and subjects:", "", "SPIEGEL_CHANGES_BATCH"},
		{[]string{"--help-all"}, 0, true, "SPIEGEL_CHANGES_BATCH", "", "left out"},
	}
	for _, c := range cases {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			var out, errOut bytes.Buffer
			code, done := ConsumerFront("onchange", "onchange — test", c.args, &OnChange{}, &out, &errOut)
			assert.Equal(t, c.code, code)
			assert.Equal(t, c.done, done)
			assert.Contains(t, out.String(), c.out)
			assert.Contains(t, errOut.String(), c.err)
			if c.notInOut != "" {
				assert.NotContains(t, out.String(), c.notInOut)
			}
		})
	}
}

// Help lists the variables by group, the advanced ones only with --help-all, in lines of at
// most HelpWidth characters; every SPEC §6 variable is in the short help.
func TestHelpGroupsAndWidth(t *testing.T) {
	t.Parallel()
	for _, spec := range []any{&Producer{}, &Replicator{}, &OnChange{}} {
		var short, all bytes.Buffer
		PrintHelp(&short, "x", spec)
		PrintHelpAll(&all, "x", spec)
		for _, out := range []string{short.String(), all.String()} {
			for _, l := range strings.Split(out, "\n") {
				assert.LessOrEqual(t, len([]rune(l)), HelpWidth, l)
			}
		}
		for _, v := range Vars(spec) {
			if v.Deprecated != "" {
				assert.NotContains(t, all.String(), v.Name+" ", "help leaves the old names out")
				continue
			}
			assert.NotEmpty(t, v.Group, v.Name)
			assert.Contains(t, all.String(), "    "+v.Name+" ")
			if v.Advanced {
				assert.NotContains(t, short.String(), "    "+v.Name+" ")
			} else {
				assert.Contains(t, short.String(), "    "+v.Name+" ")
			}
		}
		assert.Contains(t, short.String(), "  CouchDB:\n")
		assert.Contains(t, short.String(), "  NATS:\n")
		assert.Contains(t, short.String(), "  Logging:\n")
	}
	for _, name := range []string{"SPIEGEL_COUCHDB_URL", "SPIEGEL_DB_NAME", "SPIEGEL_NATS_URL", "SPIEGEL_SUBJECT_PREFIX",
		"SPIEGEL_HTTP_ADDR", "SPIEGEL_LOG_LEVEL", "SPIEGEL_LOG_FORMAT", "SPIEGEL_ACK_WAIT", "SPIEGEL_SOURCE"} {
		for _, v := range Vars(&Producer{}) {
			if v.Name == name {
				assert.False(t, v.Advanced, "%s is in SPEC §6: the short help lists it", name)
			}
		}
	}
	for _, name := range []string{"SPIEGEL_CONCURRENCY", "SPIEGEL_PASSWORDS_FILE"} {
		for _, v := range Vars(&OnChange{}) {
			if v.Name == name {
				assert.False(t, v.Advanced, name)
			}
		}
	}
}
