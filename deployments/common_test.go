package deployments

import (
	"os"
	"path"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/stretchr/testify/require"
)

// The three binaries of the image, by the base name of their command.
var binaries = []string{"producer", "replicator", "onchange"}

// specOf returns a fresh configuration struct of a binary.
func specOf(t *testing.T, bin string) interface{ Validate() error } {
	t.Helper()
	switch bin {
	case "producer":
		return &config.Producer{}
	case "replicator":
		return &config.Replicator{}
	case "onchange":
		return &config.OnChange{}
	}
	t.Fatalf("unknown binary %q", bin)
	return nil
}

// binaryOf is the binary a command runs: /usr/local/bin/replicator → replicator.
func binaryOf(t *testing.T, command []string) string {
	t.Helper()
	require.NotEmpty(t, command, "a Spiegel container must name its binary as the command")
	bin := path.Base(command[0])
	require.Contains(t, binaries, bin, "command %q", command)
	require.Equal(t, "/usr/local/bin/"+bin, command[0], "binaries live in /usr/local/bin")
	return bin
}

// vars are the SPIEGEL_* variables of a binary, by name.
func vars(t *testing.T, bin string) map[string]config.Var {
	t.Helper()
	out := map[string]config.Var{}
	for _, v := range config.Vars(specOf(t, bin)) {
		out[v.Name] = v
	}
	require.NotEmpty(t, out)
	return out
}

// defaultPort is the port of the binary's default SPIEGEL_HTTP_ADDR (":8081" → 8081).
func defaultPort(t *testing.T, bin string) int {
	t.Helper()
	v, ok := vars(t, bin)["SPIEGEL_HTTP_ADDR"]
	require.True(t, ok, "%s has no SPIEGEL_HTTP_ADDR", bin)
	return portOf(t, v.Default)
}

func portOf(t *testing.T, addr string) int {
	t.Helper()
	i := strings.LastIndex(addr, ":")
	require.True(t, i >= 0, "address %q has no port", addr)
	p, err := strconv.Atoi(addr[i+1:])
	require.NoError(t, err, "address %q", addr)
	return p
}

// shutdownGrace is the SPIEGEL_SHUTDOWN_GRACE the binary runs with under env.
func shutdownGrace(t *testing.T, bin string, env map[string]string) time.Duration {
	t.Helper()
	s, ok := env["SPIEGEL_SHUTDOWN_GRACE"]
	if !ok {
		s = vars(t, bin)["SPIEGEL_SHUTDOWN_GRACE"].Default
	}
	d, err := time.ParseDuration(s)
	require.NoError(t, err)
	return d
}

// checkEnv asserts that env configures bin: every SPIEGEL_* name is one of its variables (so a
// renamed or misspelt variable fails), every required one is set, and config.Load accepts the
// values. files maps paths named by the environment (SPIEGEL_PASSWORDS_FILE) to local files with
// the same content, since the container paths do not exist here.
func checkEnv(t *testing.T, where, bin string, env map[string]string, files map[string]string) {
	t.Helper()
	known := vars(t, bin)
	for name := range env {
		if !strings.HasPrefix(name, "SPIEGEL_") {
			continue
		}
		_, ok := known[name]
		require.True(t, ok, "%s: %s is not a variable of %s", where, name, bin)
	}
	for name, v := range known {
		if v.Required {
			require.NotEmpty(t, env[name], "%s: required %s is not set", where, name)
		}
	}
	// config.Load reads the process environment: clear every SPIEGEL_* first.
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "SPIEGEL_") {
			t.Setenv(name, "")
			require.NoError(t, os.Unsetenv(name))
		}
	}
	for name, value := range env {
		if local, ok := files[value]; ok && strings.HasSuffix(name, "_FILE") {
			value = local
		}
		t.Setenv(name, value)
	}
	require.NoError(t, config.Load(specOf(t, bin)), "%s: %s rejects its configuration", where, bin)
}

func itoa(n int) string { return strconv.Itoa(n) }
