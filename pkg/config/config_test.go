package config

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSpecVariablesExist(t *testing.T) {
	t.Parallel()
	names := map[string]bool{}
	for _, v := range Vars(&OnChange{}) {
		names[v.Name] = true
	}
	for _, v := range Vars(&Producer{}) {
		names[v.Name] = true
	}
	for _, want := range []string{"SPIEGEL_COUCHDB_URL", "SPIEGEL_DB_NAME", "SPIEGEL_NATS_URL", "SPIEGEL_SUBJECT_PREFIX",
		"SPIEGEL_PASSWORDS_FILE", "SPIEGEL_HTTP_ADDR", "SPIEGEL_LOG_LEVEL", "SPIEGEL_LOG_FORMAT", "SPIEGEL_CONCURRENCY",
		"SPIEGEL_ACK_WAIT", "SPIEGEL_SOURCE"} {
		assert.True(t, names[want], want)
	}
}

func TestLoadErrorsNameTheVariable(t *testing.T) {
	cases := []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{}, "SPIEGEL_COUCHDB_URL is required"},
		{map[string]string{"SPIEGEL_COUCHDB_URL": "ftp://x"}, "SPIEGEL_COUCHDB_URL"},
		{map[string]string{"SPIEGEL_COUCHDB_URL": "http://x", "SPIEGEL_SOURCE": "magic"}, "SPIEGEL_SOURCE"},
		{map[string]string{"SPIEGEL_COUCHDB_URL": "http://x", "SPIEGEL_ACK_WAIT": "soon"}, "SPIEGEL_ACK_WAIT"},
		{map[string]string{"SPIEGEL_COUCHDB_URL": "http://x", "SPIEGEL_LOG_LEVEL": "loud"}, "SPIEGEL_LOG_LEVEL"},
		{map[string]string{"SPIEGEL_COUCHDB_URL": "http://x", "SPIEGEL_SUBJECT_PREFIX": "a..b"}, "SPIEGEL_SUBJECT_PREFIX"},
		{map[string]string{"SPIEGEL_COUCHDB_URL": "http://x", "SPIEGEL_START": "later"}, "SPIEGEL_START"},
	}
	for _, c := range cases {
		t.Setenv("COUCHDB_URL", "http://from-the-bare-name:5984")
		for _, k := range []string{"SPIEGEL_COUCHDB_URL", "SPIEGEL_SOURCE", "SPIEGEL_ACK_WAIT", "SPIEGEL_LOG_LEVEL", "SPIEGEL_SUBJECT_PREFIX", "SPIEGEL_START"} {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		var p Producer
		err := Load(&p)
		require.Error(t, err, "%v", c.env)
		assert.Contains(t, err.Error(), c.want)
	}
}

// Only SPIEGEL_* variables configure the service: a bare COUCHDB_URL or LOG_LEVEL in the
// environment (envconfig's fallback) must not.
func TestBareVariablesAreIgnored(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:5984")
	t.Setenv("COUCHDB_URL", "http://other:5984")
	t.Setenv("LOG_LEVEL", "debug")
	t.Setenv("CONCURRENCY", "3")
	var o OnChange
	require.NoError(t, Load(&o))
	assert.Equal(t, "http://127.0.0.1:5984", o.CouchDBURL)
	assert.Equal(t, "info", o.LogLevel)
	assert.Equal(t, 20, o.Concurrency)
}

func TestLoadDefaults(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://admin:pw@127.0.0.1:5984")
	var r Replicator
	require.NoError(t, Load(&r))
	assert.Equal(t, ":8081", r.HTTPAddr)
	assert.Equal(t, 20, r.Concurrency)
	assert.Equal(t, "spiegel", r.DBName)
	var o OnChange
	require.NoError(t, Load(&o))
	assert.Equal(t, ":8082", o.HTTPAddr)
	var buf bytes.Buffer
	PrintHelp(&buf, "onchange — test", &o)
	assert.Contains(t, buf.String(), "SPIEGEL_WEBHOOK_ALLOWED_HOSTS")
	assert.Contains(t, buf.String(), "(required)")
}

// Values that do not parse are named with the variable and what is expected; lists are trimmed.
func TestLoadParsesValues(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:5984")
	t.Setenv("SPIEGEL_WEBHOOK_ALLOWED_HOSTS", " api.example , ,hooks.example:8443,")
	var o OnChange
	require.NoError(t, Load(&o))
	assert.Equal(t, []string{"api.example", "hooks.example:8443"}, o.AllowedHosts)

	for k, want := range map[string]string{
		"SPIEGEL_ACK_WAIT":                     `SPIEGEL_ACK_WAIT="soon": not a duration`,
		"SPIEGEL_CONCURRENCY":                  `SPIEGEL_CONCURRENCY="soon": not an integer`,
		"SPIEGEL_COUCHDB_INSECURE_SKIP_VERIFY": `SPIEGEL_COUCHDB_INSECURE_SKIP_VERIFY="soon": not a boolean`,
	} {
		t.Run(k, func(t *testing.T) {
			t.Setenv(k, "soon")
			var o OnChange
			err := Load(&o)
			require.Error(t, err)
			assert.Contains(t, err.Error(), want)
		})
	}
}

// The webhook and subject security settings: lists parse, bad entries stop the start with the
// variable named.
func TestOnChangeSecuritySettings(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:5984")
	t.Setenv("SPIEGEL_WEBHOOK_ALLOWED_HOSTS", "127.0.0.1,10.0.0.0/8,fd00::/8,*.example")
	t.Setenv("SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES", "hmac_new, hmac_old")
	t.Setenv("SPIEGEL_PUBLISH_ALLOWED_SUBJECTS", "orders.>,audit.*.changes")
	var o OnChange
	require.NoError(t, Load(&o))
	assert.Equal(t, []string{"127.0.0.1", "10.0.0.0/8", "fd00::/8", "*.example"}, o.AllowedHosts)
	assert.Equal(t, []string{"hmac_new", "hmac_old"}, o.SignatureSecrets)
	assert.Equal(t, []string{"orders.>", "audit.*.changes"}, o.AllowedSubjects)

	for k, tc := range map[string]struct{ value, want string }{
		"SPIEGEL_WEBHOOK_ALLOWED_HOSTS":    {"10.0.0.0/33", `SPIEGEL_WEBHOOK_ALLOWED_HOSTS: "10.0.0.0/33" is not a CIDR range`},
		"SPIEGEL_PUBLISH_ALLOWED_SUBJECTS": {"orders.>.x", `SPIEGEL_PUBLISH_ALLOWED_SUBJECTS: "orders.>.x": '>' must be the last token`},
	} {
		t.Run(k, func(t *testing.T) {
			t.Setenv(k, tc.value)
			var o OnChange
			err := Load(&o)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

// HTTPAddr reads the listener address alone: the binary's default, the variable when set (even
// to "", which turns the listener off), and nothing else, not even a missing required variable.
func TestHTTPAddr(t *testing.T) {
	t.Setenv("SPIEGEL_HTTP_ADDR", "")
	require.NoError(t, os.Unsetenv("SPIEGEL_HTTP_ADDR"))
	t.Setenv("SPIEGEL_COUCHDB_URL", "not a url") // Load would refuse it; HTTPAddr does not read it
	assert.Equal(t, ":8080", HTTPAddr(&Producer{}))
	assert.Equal(t, ":8081", HTTPAddr(&Replicator{}))
	assert.Equal(t, ":8082", HTTPAddr(&OnChange{}))
	t.Setenv("SPIEGEL_HTTP_ADDR", "127.0.0.1:9100")
	assert.Equal(t, "127.0.0.1:9100", HTTPAddr(&OnChange{}))
	t.Setenv("SPIEGEL_HTTP_ADDR", "")
	assert.Equal(t, "", HTTPAddr(&Replicator{}))
}

// SPIEGEL_COUCHDB_MAX_CONNECTIONS: auto by default (half of SPIEGEL_CONCURRENCY, at least 4; the
// producer picks its own), a number, 0 for no cap; anything else is refused with the variable named.
func TestCouchDBMaxConnections(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:5984")
	var o OnChange
	require.NoError(t, Load(&o))
	assert.Equal(t, AutoConns, o.CouchDBMaxConns)
	assert.Equal(t, 10, o.CouchDBMaxConns.For(o.Concurrency))
	assert.Equal(t, 4, o.CouchDBMaxConns.For(3))
	assert.Equal(t, 8, o.CouchDBMaxConns.Or(8))

	for value, want := range map[string]int{"auto": 10, "AUTO": 10, "8": 8, "0": 0} {
		t.Setenv("SPIEGEL_COUCHDB_MAX_CONNECTIONS", value)
		var o OnChange
		require.NoError(t, Load(&o), value)
		assert.Equal(t, want, o.CouchDBMaxConns.For(o.Concurrency), value)
		assert.Equal(t, want, o.CouchDBMaxConns.For(o.Concurrency), value)
	}
	for value, want := range map[string]string{
		"many": `SPIEGEL_COUCHDB_MAX_CONNECTIONS="many": want auto or a number of connections, not "many"`,
		"-2":   "SPIEGEL_COUCHDB_MAX_CONNECTIONS=-2: want auto, 0 (no cap) or up to 10000",
	} {
		t.Setenv("SPIEGEL_COUCHDB_MAX_CONNECTIONS", value)
		var o OnChange
		err := Load(&o)
		require.Error(t, err, value)
		assert.Contains(t, err.Error(), want)
	}
}

// The retention of the streams install creates and the bound on unacknowledged jobs of its
// consumers: defaults, 0 for forever, and bad values refused with the variable named.
func TestInstallSettings(t *testing.T) {
	t.Setenv("SPIEGEL_COUCHDB_URL", "http://127.0.0.1:5984")
	var p Producer
	require.NoError(t, Load(&p))
	assert.Equal(t, 168*time.Hour, p.ChangesMaxAge)
	assert.Equal(t, 720*time.Hour, p.DeadLetterMaxAge)
	assert.Equal(t, 1000, p.MaxAckPending)

	t.Setenv("SPIEGEL_CHANGES_MAX_AGE", "0")
	t.Setenv("SPIEGEL_DEADLETTER_MAX_AGE", "2160h")
	t.Setenv("SPIEGEL_MAX_ACK_PENDING", "64")
	p = Producer{}
	require.NoError(t, Load(&p))
	assert.Equal(t, time.Duration(0), p.ChangesMaxAge, "0: forever")
	assert.Equal(t, 2160*time.Hour, p.DeadLetterMaxAge)
	assert.Equal(t, 64, p.MaxAckPending)

	for _, c := range []struct{ name, value, want string }{
		{"SPIEGEL_CHANGES_MAX_AGE", "-1h", "SPIEGEL_CHANGES_MAX_AGE=-1h0m0s: want 0 (forever) or at least 1s"},
		{"SPIEGEL_CHANGES_MAX_AGE", "10ms", "SPIEGEL_CHANGES_MAX_AGE=10ms: want 0 (forever) or at least 1s"},
		{"SPIEGEL_CHANGES_MAX_AGE", "a week", `SPIEGEL_CHANGES_MAX_AGE="a week"`},
		{"SPIEGEL_DEADLETTER_MAX_AGE", "-720h", "SPIEGEL_DEADLETTER_MAX_AGE=-720h0m0s: want 0 (forever) or at least 1s"},
		{"SPIEGEL_MAX_ACK_PENDING", "-1", "SPIEGEL_MAX_ACK_PENDING=-1: must be at least 1"},
		{"SPIEGEL_MAX_ACK_PENDING", "0", "SPIEGEL_MAX_ACK_PENDING=0: must be at least 1"},
	} {
		t.Run(c.name+"="+c.value, func(t *testing.T) {
			t.Setenv(c.name, c.value)
			var p Producer
			err := Load(&p)
			require.Error(t, err)
			assert.Contains(t, err.Error(), c.want)
		})
	}
}
