package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// permissionsConf is the example of least-privilege users, relative to the repository root.
const permissionsConf = "deployments/nats/permissions.conf"

// natsUsers are the users permissionsConf defines, by role, and the variable of each password.
var natsUsers = map[string]string{
	"spiegel-admin":      "SPIEGEL_ADMIN_NATS_PASSWORD",
	"spiegel-producer":   "SPIEGEL_PRODUCER_NATS_PASSWORD",
	"spiegel-replicator": "SPIEGEL_REPLICATOR_NATS_PASSWORD",
	"spiegel-onchange":   "SPIEGEL_ONCHANGE_NATS_PASSWORD",
	"spiegel-status":     "SPIEGEL_STATUS_NATS_PASSWORD",
}

// violations records the permission violations a nats-server logs (it logs every publish or
// subscription a user's permissions refuse, and tells the client).
type violations struct {
	mu    sync.Mutex
	lines []string
}

func (v *violations) Errorf(format string, a ...any) {
	line := fmt.Sprintf(format, a...)
	if strings.Contains(line, "Violation") {
		v.mu.Lock()
		v.lines = append(v.lines, line)
		v.mu.Unlock()
	}
}
func (v *violations) Noticef(string, ...any) {}
func (v *violations) Warnf(string, ...any)   {}
func (v *violations) Fatalf(string, ...any)  {}
func (v *violations) Debugf(string, ...any)  {}
func (v *violations) Tracef(string, ...any)  {}

func (v *violations) all() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return slices.Clone(v.lines)
}

// mirrorPermissions are what deployments/README.md ("NATS permissions") tells the operator to add
// to the onchange and status users for a rule's mirror bucket.
func mirrorPermissions(bucket string) (onchange, status []string) {
	return []string{
			"$KV." + bucket + ".>", "$JS.API.STREAM.INFO.KV_" + bucket, "$JS.API.STREAM.CREATE.KV_" + bucket,
			"$JS.API.STREAM.MSG.GET.KV_" + bucket, "$JS.API.DIRECT.GET.KV_" + bucket + ".>", "$JS.API.STREAM.PURGE.KV_" + bucket,
			"$JS.API.CONSUMER.CREATE.KV_" + bucket + ".>", "$JS.API.CONSUMER.MSG.NEXT.KV_" + bucket + ".>",
		}, []string{
			"$JS.API.STREAM.INFO.KV_" + bucket, "$JS.API.STREAM.MSG.GET.KV_" + bucket,
		}
}

// loadPermissions parses permissionsConf with the passwords of natsUsers, adds extra publish
// permissions by user (what the operator adds for the rules' names), and returns its users.
func loadPermissions(t *testing.T, root string, passwords map[string]string, extra map[string][]string) []*server.User {
	t.Helper()
	for user, env := range natsUsers {
		t.Setenv(env, passwords[user])
	}
	opts, err := server.ProcessConfigFile(filepath.Join(root, permissionsConf))
	require.NoError(t, err, "parse %s", permissionsConf)
	var names []string
	for _, u := range opts.Users {
		names = append(names, u.Username)
		require.Equal(t, passwords[u.Username], u.Password, "password of %s", u.Username)
		require.NotNil(t, u.Permissions, "%s has permissions", u.Username)
		u.Permissions.Publish.Allow = append(u.Permissions.Publish.Allow, extra[u.Username]...)
	}
	want := slices.Sorted(func(yield func(string) bool) {
		for u := range natsUsers {
			if !yield(u) {
				return
			}
		}
	})
	slices.Sort(names)
	require.Equal(t, want, names, "the users of %s", permissionsConf)
	return opts.Users
}

// TestLeastPrivilegeNATSUsers runs `producer install`, the producer, the replicator, the
// onchange consumer and `producer status` (and the other admin commands) each as its user of
// deployments/nats/permissions.conf, on a server that knows only those users (plus the test's
// own observer), and checks that the pipeline does its work — a doc replicated, a webhook
// called, a change published, a mirror kept, dead letters recorded — and that the server
// refused nothing any of them sent or subscribed to: a subject the code starts to use and the
// file does not allow fails the test. Then it checks that the file does refuse: the onchange
// user cannot delete the work stream, the status user cannot enqueue a job.
func TestLeastPrivilegeNATSUsers(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole pipeline")
	}
	root := repoRoot(t, "producer", "replicator", "onchange")
	bin := func(name string) string { return filepath.Join(root, "bin", name) }
	cs := couchtest.Get(t)

	const mirror = "E2E_PERMISSIONS_MIRROR"
	passwords := map[string]string{}
	for user := range natsUsers {
		passwords[user] = newSecret(t, "natsPw-", "")
	}
	onchangeMirror, statusMirror := mirrorPermissions(mirror)
	users := loadPermissions(t, root, passwords, map[string][]string{
		"spiegel-onchange": onchangeMirror, "spiegel-status": statusMirror})
	observerPW := newSecret(t, "observer-", "")
	ns := natstest.Start(t, func(o *server.Options) {
		o.Users = append(users, &server.User{Username: "e2e-observer", Password: observerPW})
	})
	refused := &violations{}
	ns.SetLogger(refused, false, false)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("permission violations the server logged:\n%s", strings.Join(refused.all(), "\n"))
		}
	})

	nc, err := nats.Connect(ns.URL(), nats.UserInfo("e2e-observer", observerPW))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)

	// Servers: the replication target and the webhook receiver check the credentials the
	// passwords file gives; one webhook address refuses connections (dead letters).
	targetPW, hookPW := newSecret(t, "target-", ""), newSecret(t, "hook-", "")
	target := newAuthProxy(t, cs.URL, "repl", targetPW)
	sink := newHookSink(t, "hook", hookPW)
	closed := freeAddr(t)
	pwFile := filepath.Join(t.TempDir(), "passwords.json")
	data, err := json.Marshal(map[string]map[string]string{
		hostPort(target.Server): {"repl": targetPW},
		hostPort(sink.Server):   {"hook": hookPW},
		closed:                  {"hook": hookPW},
	})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(pwFile, data, 0o600))

	spiegelDB := couchtest.UniqueName(t, "e2e_perm_spiegel_")
	src := couchtest.UniqueName(t, "e2e_perm_src_")
	for _, db := range []string{spiegelDB, src, "t_" + src} {
		cs.Cleanup(t, db)
	}
	as := func(user string, extra ...string) []string {
		return baseEnv(append([]string{
			"SPIEGEL_COUCHDB_URL=" + cs.URL,
			"SPIEGEL_DB_NAME=" + spiegelDB,
			"SPIEGEL_NATS_URL=" + ns.URL(),
			"SPIEGEL_NATS_USER=" + user,
			"SPIEGEL_NATS_PASSWORD=" + passwords[user],
			"SPIEGEL_PASSWORDS_FILE=" + pwFile,
			"SPIEGEL_SHUTDOWN_GRACE=5s",
			"SPIEGEL_RETRY_INITIAL=200ms",
			"SPIEGEL_RETRY_MAX=1s",
		}, extra...)...)
	}

	out, code := runCmd(t, bin("producer"), as("spiegel-admin"), "install")
	require.Equal(t, 0, code, "producer install as spiegel-admin:\n%s", out)

	pattern := "^" + regexp.QuoteMeta(src) + "$"
	for id, doc := range map[string]map[string]any{
		"replicate": {"type": "replicator", "db_name": pattern, "source": "$db_name", "engine": "native",
			"target": "http://repl@" + hostPort(target.Server) + "/t_${db_name}", "create_target": true},
		"hook": {"type": "on_change", "db_name": pattern, "method": "POST", "url": "http://hook@" + hostPort(sink.Server) + "/hook/${db_name}",
			"params": map[string]any{"db": "$db_name", "id": "$change.id"}},
		"hook_dead": {"type": "on_change", "db_name": pattern, "method": "POST", "url": "http://hook@" + closed + "/dead",
			"retry": map[string]any{"backoff": "linear", "delay_ms": 100, "limit": 1}},
		"publish": {"type": "on_change", "db_name": pattern, "subject": "spiegel.changes.${db_name}"},
		"mirror":  {"type": "on_change", "db_name": pattern, "mirror": mirror},
	} {
		cs.Put(t, spiegelDB, id, doc)
	}

	pAddr, rAddr, oAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	prod := startProc(t, "producer", bin("producer"), pAddr, as("spiegel-producer", "SPIEGEL_HTTP_ADDR="+pAddr,
		"SPIEGEL_POLL_INTERVAL=200ms", "SPIEGEL_POSITION_SAVE_INTERVAL=500ms", "SPIEGEL_SWEEP_INTERVAL=2s"))
	repl := startProc(t, "replicator", bin("replicator"), rAddr, as("spiegel-replicator", "SPIEGEL_HTTP_ADDR="+rAddr))
	onch := startProc(t, "onchange", bin("onchange"), oAddr, as("spiegel-onchange", "SPIEGEL_HTTP_ADDR="+oAddr))
	procs := []*proc{prod, repl, onch}
	for _, p := range procs {
		waitFor(t, 30*time.Second, p.name+" ready", procs, func() bool { code, _ := p.get("/readyz"); return code == http.StatusOK })
	}
	cs.CreateDB(t, src)
	for i := range 3 {
		cs.Put(t, src, fmt.Sprintf("doc%d", i), map[string]any{"n": i})
	}

	waitFor(t, 40*time.Second, "every doc replicated to the target", procs, func() bool {
		return len(docIDs(t, cs, "t_"+src)) == 3
	})
	waitFor(t, 30*time.Second, "a webhook call for every doc", procs, func() bool {
		n := 0
		for _, c := range sink.all() {
			if strings.HasPrefix(c.Path, "/hook/") && c.User == "hook" && c.Password == hookPW {
				n++
			}
		}
		return n >= 3
	})
	waitFor(t, 30*time.Second, "every change published to SPIEGEL_CHANGES", procs, func() bool {
		return len(streamMessages(t, js, "SPIEGEL_CHANGES")) >= 3
	})
	waitFor(t, 30*time.Second, "every doc in the mirror bucket", procs, func() bool {
		return len(streamMessages(t, js, "KV_"+mirror)) >= 3
	})
	waitFor(t, 30*time.Second, "a dead letter of the unreachable webhook", procs, func() bool {
		return len(streamMessages(t, js, "SPIEGEL_DEADLETTER")) >= 1
	})
	waitFor(t, 30*time.Second, "completion records of both groups (the producer's sweep reads them every 2s)", procs, func() bool {
		return len(streamMessages(t, js, "KV_SPIEGEL_DONE")) >= 2
	})
	for _, p := range procs {
		code, _ := p.get("/metrics") // the job gauges read both consumers' infos
		assert.Equal(t, http.StatusOK, code, "%s /metrics", p.name)
	}

	// The read-only user sees the running processes; the admin commands run as the admin.
	out, code = runCmd(t, bin("producer"), as("spiegel-status"), "status", "--json")
	require.Equal(t, 0, code, "producer status as spiegel-status:\n%s", out)
	var st struct {
		Processes []struct{ Component string }
	}
	require.NoError(t, json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &st), "status output:\n%s", out)
	assert.Len(t, st.Processes, 3, "producer status lists the three processes:\n%s", out)
	for _, args := range [][]string{
		{"deadletters", "list"},
		{"resync"},
		{"replay", "--rule", "publish"},
		{"rules", "list"},
	} {
		out, code := runCmd(t, bin("producer"), as("spiegel-admin"), args...)
		assert.Equal(t, 0, code, "producer %s as spiegel-admin:\n%s", strings.Join(args, " "), out)
	}
	cs.Put(t, src, "after_admin", map[string]any{"n": 9})
	waitFor(t, 30*time.Second, "the doc written after the admin commands replicated", procs, func() bool {
		return len(docIDs(t, cs, "t_"+src)) == 4
	})

	// A deleted db: the producer drops its completion records and cached checkpoints, onchange
	// its mirror keys.
	require.NoError(t, cs.Do(t, http.MethodDelete, "/"+couchtest.PathDB(src), nil, nil))
	waitFor(t, 30*time.Second, "the deleted db's completion records and mirror keys dropped", procs, func() bool {
		return len(streamMessages(t, js, "KV_SPIEGEL_DONE")) == 0 && len(kvKeys(t, js, mirror)) == 0
	})

	for _, p := range procs {
		assert.NoError(t, p.stop(20*time.Second), "%s exit", p.name)
	}
	out, code = runCmd(t, bin("producer"), as("spiegel-admin"), "uninstall", "--yes", "--keep-db")
	assert.Equal(t, 0, code, "producer uninstall as spiegel-admin:\n%s", out)
	assert.Empty(t, refused.all(), "the server refused what a process of %s needs", permissionsConf)

	// The file refuses too: the onchange user cannot delete the work stream, nor the status
	// user enqueue a job. Both requests are refused by the server, which logs them.
	out, code = runCmd(t, bin("producer"), as("spiegel-admin"), "install")
	require.Equal(t, 0, code, "producer install as spiegel-admin:\n%s", out)
	for _, c := range []struct{ user, subject string }{
		{"spiegel-onchange", "$JS.API.STREAM.DELETE.SPIEGEL_WORK"},
		{"spiegel-status", "spiegel.work.replicate.x"},
	} {
		unc, err := nats.Connect(ns.URL(), nats.UserInfo(c.user, passwords[c.user]), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		_, err = unc.RequestWithContext(ctx, c.subject, nil)
		cancel()
		assert.Error(t, err, "%s: %s", c.user, c.subject)
		unc.Close()
		assert.Eventually(t, func() bool {
			return slices.ContainsFunc(refused.all(), func(l string) bool {
				return strings.Contains(l, c.user) && strings.Contains(l, c.subject)
			})
		}, 5*time.Second, 50*time.Millisecond, "no violation logged for %s on %s: %q", c.user, c.subject, refused.all())
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	_, err = js.Stream(ctx, "SPIEGEL_WORK")
	assert.NoError(t, err, "the work stream survived the onchange user's delete")
}

// kvKeys returns the keys of bucket (none when it does not exist).
func kvKeys(t testing.TB, js jetstream.JetStream, bucket string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return nil
	}
	keys, err := kv.Keys(ctx)
	if err != nil {
		return nil // jetstream.ErrNoKeysFound
	}
	return keys
}
