package deployments

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
	"github.com/spiegel-nats/spiegel/pkg/health"
	"github.com/spiegel-nats/spiegel/pkg/passwords"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// loadCompose loads docker-compose.yml with the compose-spec loader (schema validation,
// interpolation, normalization, consistency checks), as `docker compose config` would.
func loadCompose(t *testing.T, env map[string]string) (*types.Project, error) {
	t.Helper()
	wd, err := filepath.Abs(".")
	require.NoError(t, err)
	return loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  wd,
		ConfigFiles: []types.ConfigFile{{Filename: filepath.Join(wd, "docker-compose.yml")}},
		Environment: env,
	}, func(o *loader.Options) {
		o.SetProjectName("spiegel", true)
		o.ResolvePaths = true
	})
}

func TestComposeNeedsAPassword(t *testing.T) {
	t.Parallel()
	_, err := loadCompose(t, map[string]string{})
	require.Error(t, err, "COUCHDB_PASSWORD has no default")
	assert.Contains(t, err.Error(), "COUCHDB_PASSWORD")
}

func TestCompose(t *testing.T) { // not parallel: checkEnv sets the environment
	const password = "pw-for-the-test"
	p, err := loadCompose(t, map[string]string{"COUCHDB_PASSWORD": password})
	require.NoError(t, err)
	repoRoot, err := filepath.Abs("..")
	require.NoError(t, err)

	want := []string{"couchdb", "couchdb-init", "nats-1", "nats-2", "nats-3", "install",
		"producer-1", "producer-2", "replicator-1", "replicator-2", "onchange-1", "onchange-2", "webhook-echo"}
	for _, name := range want {
		require.Contains(t, p.Services, name)
	}

	// CouchDB 3, single node, with its system dbs created by the one-shot init service.
	couch := p.Services["couchdb"]
	assert.Regexp(t, `^couchdb:3(\.\d+)*$`, couch.Image)
	assert.Equal(t, password, deref(couch.Environment["COUCHDB_PASSWORD"]))
	require.NotNil(t, couch.HealthCheck)
	assert.Contains(t, strings.Join(couch.HealthCheck.Test, " "), "/_up")
	initCmd := strings.Join(p.Services["couchdb-init"].Command, " ")
	for _, db := range []string{"_users", "_replicator", "_global_changes"} {
		assert.Contains(t, initCmd, db)
	}
	// The _db_updates floor the operating docs recommend, on the CouchDB this file starts:
	// max_write_delay through _config, max_event_delay too and, while it was not configured, a
	// restart of the node (CouchDB reads it only when it starts), waited for before `install`.
	assert.Contains(t, initCmd, `-X PUT "$cfg/max_write_delay" -d '"50"'`)
	assert.Contains(t, initCmd, `-X PUT "$cfg/max_event_delay" -d '"10"'`)
	assert.Contains(t, initCmd, `-X POST http://couchdb:5984/_node/_local/_restart`)
	assert.Regexp(t, `(?s)_restart.*until curl -fs -o /dev/null http://couchdb:5984/_up`, initCmd)
	assert.Equal(t, types.ServiceConditionHealthy, p.Services["couchdb-init"].DependsOn["couchdb"].Condition)

	// A three-node JetStream cluster: unique names, JetStream on with a volume and storage sync
	// "always" (an acknowledged write survives a power failure), routes to the others.
	conf, ok := p.Configs["nats-jetstream"]
	require.True(t, ok, "the nats-jetstream config")
	confText, err := os.ReadFile(conf.File)
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^\s*sync_interval:\s*always\s*$`, string(confText))
	natsNames := []string{"nats-1", "nats-2", "nats-3"}
	pinned := pinnedNATSServer(t)
	for _, name := range natsNames {
		s := p.Services[name]
		assert.Equal(t, "nats:"+pinned+"-alpine", s.Image, "%s runs the nats-server the product module pins and its tests use", name)
		cmd := strings.Join(s.Command, " ")
		assert.Contains(t, cmd, "--js", name)
		assert.Contains(t, cmd, "--server_name "+name, name)
		assert.Contains(t, cmd, "--cluster_name spiegel", name)
		assert.Contains(t, cmd, "--store_dir /data", name)
		// Storage sync for production: the mounted config file sets it.
		assert.Contains(t, cmd, "-c /etc/nats/jetstream.conf", name)
		require.Len(t, s.Configs, 1, name)
		assert.Equal(t, "nats-jetstream", s.Configs[0].Source, name)
		assert.Equal(t, "/etc/nats/jetstream.conf", s.Configs[0].Target, name)
		for _, other := range natsNames {
			if other != name {
				assert.Contains(t, cmd, "nats://"+other+":6222", "%s routes to %s", name, other)
			}
		}
		require.Len(t, s.Volumes, 1, name)
		assert.Equal(t, "/data", s.Volumes[0].Target, name)
		assert.Equal(t, types.VolumeTypeVolume, s.Volumes[0].Type, name)
		require.NotNil(t, s.HealthCheck, name)
	}

	// The passwords file: a file-based secret, the example parses as a passwords file.
	secret, ok := p.Secrets["spiegel-passwords"]
	require.True(t, ok)
	assert.Equal(t, filepath.Join(repoRoot, "deployments", "passwords.example.json"), secret.File)
	_, err = passwords.Load(secret.File)
	require.NoError(t, err, "passwords.example.json")

	// Every Spiegel service: the one image built from deployments/Dockerfile, hardened, configured
	// with real variables (config.Load accepts them).
	var spiegel []string
	count := map[string]int{}
	for name, s := range p.Services {
		if s.Build == nil {
			continue
		}
		spiegel = append(spiegel, name)
		assert.Equal(t, p.Services["install"].Image, s.Image, "%s: one image for every binary", name)
		assert.Equal(t, repoRoot, s.Build.Context, "%s: build context is the repository root", name)
		assert.Equal(t, "deployments/Dockerfile", s.Build.Dockerfile, name)
		_, err := os.Stat(filepath.Join(s.Build.Context, s.Build.Dockerfile))
		require.NoError(t, err)
		assert.True(t, s.ReadOnly, "%s: read-only root filesystem", name)
		assert.Contains(t, s.CapDrop, "ALL", name)
		assert.Contains(t, s.SecurityOpt, "no-new-privileges:true", name)
		assert.Empty(t, s.User, "%s: runs as the image's non-root user", name)

		bin := binaryOf(t, s.Command)
		count[strings.Join(s.Command, " ")]++
		env := map[string]string{}
		for k, v := range s.Environment {
			env[k] = deref(v)
		}
		cu, err := url.Parse(env["SPIEGEL_COUCHDB_URL"])
		require.NoError(t, err, name)
		assert.Equal(t, "couchdb:5984", cu.Host, name)
		pw, _ := cu.User.Password()
		assert.Equal(t, password, pw, "%s: the CouchDB password comes from COUCHDB_PASSWORD", name)
		var natsHosts []string
		for _, u := range strings.Split(env["SPIEGEL_NATS_URL"], ",") {
			nu, err := url.Parse(u)
			require.NoError(t, err, name)
			natsHosts = append(natsHosts, nu.Hostname())
		}
		slices.Sort(natsHosts)
		assert.Equal(t, natsNames, natsHosts, "%s: SPIEGEL_NATS_URL lists the cluster", name)
		assert.Equal(t, "3", env["SPIEGEL_STREAM_REPLICAS"], "%s: replicated streams", name)

		files := map[string]string{}
		for _, sec := range s.Secrets {
			target := sec.Target
			if !strings.HasPrefix(target, "/") {
				target = "/run/secrets/" + target
			}
			files[target] = p.Secrets[sec.Source].File
		}
		if f, ok := env["SPIEGEL_PASSWORDS_FILE"]; ok {
			require.Contains(t, files, f, "%s: SPIEGEL_PASSWORDS_FILE is a mounted secret", name)
		}
		checkEnv(t, name, bin, env, files)

		if name == "install" {
			assert.Equal(t, []string{"/usr/local/bin/producer", "install"}, []string(s.Command))
			assert.Equal(t, "no", s.Restart)
			assert.Equal(t, types.ServiceConditionCompletedSuccessfully, s.DependsOn["couchdb-init"].Condition)
			for _, n := range natsNames {
				assert.Equal(t, types.ServiceConditionHealthy, s.DependsOn[n].Condition, "install waits for %s", n)
			}
			continue
		}
		assert.Equal(t, types.ServiceConditionCompletedSuccessfully, s.DependsOn["install"].Condition,
			"%s starts after install", name)
		// The health check is the binary's own healthcheck command: in the service's environment it
		// probes /healthz on SPIEGEL_HTTP_ADDR, which must be on.
		addr := ":" + itoa(defaultPort(t, bin))
		if a, ok := env["SPIEGEL_HTTP_ADDR"]; ok {
			addr = a
		}
		probed, err := health.HealthzURL(addr)
		require.NoError(t, err, "%s: the healthcheck command needs the HTTP listener", name)
		assert.Equal(t, "http://127.0.0.1:"+itoa(portOf(t, addr))+"/healthz", probed, name)
		require.NotNil(t, s.HealthCheck, name)
		assert.Equal(t, []string{"CMD", "/usr/local/bin/" + bin, "healthcheck"},
			[]string(s.HealthCheck.Test), "%s: healthcheck on its own /healthz", name)
		if bin == "onchange" {
			assert.Contains(t, strings.Split(env["SPIEGEL_WEBHOOK_ALLOWED_HOSTS"], ","), "webhook-echo")
		}
	}
	assert.Len(t, spiegel, 7, "install, two producers, two replicators, two onchange: %v", spiegel)
	assert.Equal(t, 2, count["/usr/local/bin/producer"])
	assert.Equal(t, 2, count["/usr/local/bin/replicator"])
	assert.Equal(t, 2, count["/usr/local/bin/onchange"])

	echo := p.Services["webhook-echo"]
	assert.NotEmpty(t, echo.Image)
	assert.Equal(t, "8080", deref(echo.Environment["HTTP_PORT"]))
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// pinnedNATSServer returns the version of github.com/nats-io/nats-server/v2 that the product's
// go.mod pins (without the leading v): the server its tests embed and `make run` builds.
func pinnedNATSServer(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../go.mod")
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^\s*github\.com/nats-io/nats-server/v2 v(\S+)`).FindSubmatch(b)
	require.NotNil(t, m, "go.mod pins nats-server")
	return string(m[1])
}
