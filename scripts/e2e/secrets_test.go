package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
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

// special characters put into secrets that only Go code sends, so that their escaped forms
// (URL user info, query, JSON with HTML escaping) differ from the raw text and are looked for
// too. Secrets that PouchDB Server's own replicator must send stay plain.
const special = `+/:@?&=% <>"\`

// TestSecretsNeverShown runs the real producer, replicator and onchange binaries with every
// kind of secret they take — the CouchDB admin password in SPIEGEL_COUCHDB_URL, the NATS
// password, replication and webhook passwords and an HMAC key from the passwords file, wrong
// passwords that are refused, passwords written into (invalid) rule docs — makes them use each
// one (the servers check the credentials they receive), reloads the passwords file on SIGHUP,
// and then looks for every secret, in every form it could be written, in everything the run
// showed: each process's output, the admin commands' output, --help, /metrics, /readyz,
// /healthz, the dead-letter and change streams, and the answer of validate_doc_update.
// E2E_DUMP_DIR=<dir> writes every checked output there, one file each.
func TestSecretsNeverShown(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole pipeline")
	}
	root := repoRoot(t, "producer", "replicator", "onchange")
	bin := func(name string) string { return filepath.Join(root, "bin", name) }
	cs := couchtest.Get(t)
	started := time.Now()

	// The secrets, each distinctive, and who they belong to.
	var (
		couchPW      = newSecret(t, "couchS3cret-", "") // PouchDB Server's replicator sends it: plain
		targetPW     = newSecret(t, "targetS3cret-", "")
		refusedPW    = newSecret(t, "refusedS3cret-", special)
		hookPW       = newSecret(t, "hookS3cret-", special)
		rotatedPW    = newSecret(t, "hookRotatedS3cret-", special)
		deadHookPW   = newSecret(t, "deadHookS3cret-", special)
		hmacKey      = newSecret(t, "hmacS3cret-", special)
		natsPW       = newSecret(t, "natsS3cret-", special)
		rulePW       = newSecret(t, "ruleS3cret-", "") // inside a URL of a rule doc: plain
		wrongCouchPW = newSecret(t, "wrongCouchS3cret-", "")
		wrongNatsPW  = newSecret(t, "wrongNatsS3cret-", special)
		brokenPW     = newSecret(t, "brokenFileS3cret-", special)
	)
	secrets := []secret{
		{"CouchDB admin password (SPIEGEL_COUCHDB_URL)", "admin", couchPW},
		{"replication target password (passwords file)", "repl", targetPW},
		{"refused replication target password (passwords file)", "repl", refusedPW},
		{"webhook password (passwords file)", "hook", hookPW},
		{"rotated webhook password (passwords file after SIGHUP)", "hook", rotatedPW},
		{"unreachable webhook password (passwords file)", "hook", deadHookPW},
		{"webhook HMAC key (passwords file _secrets)", "", hmacKey},
		{"NATS password (SPIEGEL_NATS_PASSWORD)", "spiegel", natsPW},
		{"password inside invalid rule docs", "hook", rulePW},
		{"wrong CouchDB admin password", "admin", wrongCouchPW},
		{"wrong NATS password", "spiegel", wrongNatsPW},
		{"password in a broken passwords file", "hook", brokenPW},
	}
	var outs []output
	collect := func(name, text string) { outs = append(outs, output{name, text}) }

	// Servers that check the credentials they receive.
	ns := natstest.Start(t, func(o *server.Options) { o.Username, o.Password = "spiegel", natsPW })
	couchProxy := newAuthProxy(t, cs.URL, "admin", couchPW)
	targetProxy := newAuthProxy(t, cs.URL, "repl", targetPW)
	refusing := newAuthProxy(t, cs.URL, "repl", newSecret(t, "neverGiven-", "")) // refuses every request
	sink := newHookSink(t, "hook", hookPW)
	closed := freeAddr(t) // nothing listens here
	couchURL := (&url.URL{Scheme: "http", User: url.UserPassword("admin", couchPW), Host: hostPort(couchProxy.Server)}).String()

	pwFile := filepath.Join(t.TempDir(), "passwords.json")
	writeFile := func(data []byte) {
		tmp := pwFile + ".tmp"
		require.NoError(t, os.WriteFile(tmp, data, 0o600))
		require.NoError(t, os.Rename(tmp, pwFile))
	}
	writePasswords := func(hook string) {
		data, err := json.Marshal(map[string]map[string]string{
			hostPort(targetProxy.Server): {"repl": targetPW},
			hostPort(refusing.Server):    {"repl": refusedPW},
			hostPort(sink.Server):        {"hook": hook},
			closed:                       {"hook": deadHookPW},
			"_secrets":                   {"webhook_hmac": hmacKey},
		})
		require.NoError(t, err)
		writeFile(data)
	}
	writePasswords(hookPW)

	// Names unique to this run.
	spiegelDB := couchtest.UniqueName(t, "e2e_spiegel_")
	srcPrefix := couchtest.UniqueName(t, "e2e_src_") + "_"
	sources := []string{srcPrefix + "a", srcPrefix + "b"}
	const subjectPrefix = "e2esecrets"
	for _, src := range sources {
		for _, p := range []string{"", "n_", "c_", "r_", "rc_", "bad_"} {
			cs.Cleanup(t, p+src)
		}
	}

	common := []string{
		"SPIEGEL_COUCHDB_URL=" + couchURL,
		"SPIEGEL_DB_NAME=" + spiegelDB,
		"SPIEGEL_NATS_URL=" + ns.URL(),
		"SPIEGEL_NATS_USER=spiegel",
		"SPIEGEL_NATS_PASSWORD=" + natsPW,
		"SPIEGEL_SUBJECT_PREFIX=" + subjectPrefix,
		"SPIEGEL_LOG_LEVEL=debug",
		"SPIEGEL_SHUTDOWN_GRACE=5s",
	}
	producerEnv := baseEnv(slices.Concat(common, []string{"SPIEGEL_POLL_INTERVAL=200ms", "SPIEGEL_POSITION_SAVE_INTERVAL=500ms"})...)
	consumerVars := slices.Concat(common, []string{"SPIEGEL_PASSWORDS_FILE=" + pwFile, "SPIEGEL_RETRY_INITIAL=200ms", "SPIEGEL_RETRY_MAX=2s"})
	replicatorEnv := baseEnv(consumerVars...)
	// onchange logs in text format, so that both formats' quoting is checked.
	onchangeEnv := baseEnv(append(consumerVars, "SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES=webhook_hmac", "SPIEGEL_LOG_FORMAT=text")...)
	with := func(env []string, extra ...string) []string { return append(slices.Clone(env), extra...) }

	// Invalid rule docs holding a password, written before install so that no
	// validate_doc_update stops them: every process must reject them without quoting it.
	cs.CreateDB(t, spiegelDB)
	pattern := "^" + regexp.QuoteMeta(srcPrefix)
	cs.Put(t, spiegelDB, "bad_hook_rule", map[string]any{"type": "on_change", "db_name": pattern, "method": "POST",
		"url": "http://hook:" + rulePW + "@" + hostPort(sink.Server) + "/bad/${db_name}"})
	cs.Put(t, spiegelDB, "bad_replicator_rule", map[string]any{"type": "replicator", "db_name": pattern, "source": "$db_name",
		"target": "http://repl:" + rulePW + "@" + hostPort(targetProxy.Server) + "/bad_${db_name}"})

	out, code := runCmd(t, bin("producer"), producerEnv, "install")
	collect("producer install", out)
	require.Equal(t, 0, code, "producer install:\n%s", out)

	// After install, the validate_doc_update (where the server runs it) refuses such a doc; its
	// answer must not quote the password either.
	vduErr := cs.Do(t, http.MethodPut, "/"+couchtest.PathDB(spiegelDB)+"/bad_rule_after_install", map[string]any{
		"type": "on_change", "url": "http://hook:" + rulePW + "@" + hostPort(sink.Server) + "/bad"}, nil)
	if vduErr != nil {
		collect("validate_doc_update answer", vduErr.Error())
		assert.Contains(t, vduErr.Error(), "password in URL")
	} else {
		t.Log("the server does not run validate_doc_update: bad_rule_after_install is stored, and the processes must reject it")
	}

	// Valid rules whose URLs carry users only; the passwords come from the passwords file.
	tp, rp, sp := hostPort(targetProxy.Server), hostPort(refusing.Server), hostPort(sink.Server)
	ruleDocs := map[string]map[string]any{
		"replicate_native": {"type": "replicator", "db_name": pattern, "source": "$db_name", "engine": "native",
			"target": "http://repl@" + tp + "/n_${db_name}", "create_target": true},
		"replicate_couchdb": {"type": "replicator", "db_name": pattern, "source": "$db_name", "engine": "couchdb",
			"target": "http://repl@" + tp + "/c_${db_name}", "create_target": true},
		"replicate_refused": {"type": "replicator", "db_name": pattern, "source": "$db_name", "engine": "native",
			"target": "http://repl@" + rp + "/r_${db_name}", "create_target": true},
		"replicate_refused_couchdb": {"type": "replicator", "db_name": pattern, "source": "$db_name", "engine": "couchdb",
			"target": "http://repl@" + rp + "/rc_${db_name}", "create_target": true},
		"hook": {"type": "on_change", "db_name": pattern, "method": "POST", "url": "http://hook@" + sp + "/hook/${db_name}",
			"params": map[string]any{"db": "$db_name", "id": "$change.id"}},
		"hook_dead": {"type": "on_change", "db_name": pattern, "method": "POST", "url": "http://hook@" + closed + "/dead/${db_name}",
			"params": map[string]any{"id": "$change.id"}, "retry": map[string]any{"backoff": "linear", "delay_ms": 100, "limit": 1}},
		"publish": {"type": "on_change", "db_name": pattern, "subject": subjectPrefix + ".changes.${db_name}"},
	}
	for id, doc := range ruleDocs {
		cs.Put(t, spiegelDB, id, doc)
	}

	// The pipeline.
	pAddr, rAddr, oAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	prod := startProc(t, "producer", bin("producer"), pAddr, with(producerEnv, "SPIEGEL_HTTP_ADDR="+pAddr))
	repl := startProc(t, "replicator", bin("replicator"), rAddr, with(replicatorEnv, "SPIEGEL_HTTP_ADDR="+rAddr))
	onch := startProc(t, "onchange", bin("onchange"), oAddr, with(onchangeEnv, "SPIEGEL_HTTP_ADDR="+oAddr))
	procs := []*proc{prod, repl, onch}
	for _, p := range procs {
		waitFor(t, 30*time.Second, p.name+" ready", procs, func() bool { code, _ := p.get("/readyz"); return code == http.StatusOK })
	}
	for _, src := range sources {
		cs.CreateDB(t, src)
		for i := range 3 {
			cs.Put(t, src, fmt.Sprintf("doc%d", i), map[string]any{"n": i, "text": "not a secret"})
		}
	}

	// Every secret is used: replications through the checking proxies, webhook calls with the
	// password and signature, refusals, dead letters.
	nc, err := nats.Connect(ns.URL(), nats.UserInfo("spiegel", natsPW))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	streamBase := strings.ToUpper(subjectPrefix)
	waitFor(t, 40*time.Second, "both engines replicated every db through the target proxy", procs, func() bool {
		for _, src := range sources {
			if len(docIDs(t, cs, "n_"+src)) != 3 || len(docIDs(t, cs, "c_"+src)) != 3 {
				return false
			}
		}
		return true
	})
	waitFor(t, 30*time.Second, "a signed, authenticated webhook call for every doc", procs, func() bool {
		return len(goodCalls(sink.all(), srcPrefix, hookPW, hmacKey)) == 6
	})
	waitFor(t, 30*time.Second, "dead letters of the unreachable webhook and the refused replication", procs, func() bool {
		rules := map[string]bool{}
		for _, m := range streamMessages(t, js, streamBase+"_DEADLETTER") {
			var rec struct{ Rule string }
			if json.Unmarshal(m.Data, &rec) == nil {
				rules[rec.Rule] = true
			}
		}
		return rules["hook_dead"] && rules["replicate_refused"]
	})
	waitFor(t, 30*time.Second, "every change published", procs, func() bool {
		return len(streamMessages(t, js, streamBase+"_CHANGES")) >= 6
	})
	assert.True(t, refusing.sawRefused("repl:"+refusedPW), "the refused target never saw the refused password")
	passed, _ := couchProxy.counts()
	assert.Positive(t, passed, "no request reached CouchDB with the admin password")
	passed, _ = targetProxy.counts()
	assert.Positive(t, passed, "no request reached the target with its password")

	// SIGHUP reloads the passwords file: a rotated webhook password is used from then on. A
	// broken file is refused without quoting its content.
	sink.accept(rotatedPW)
	writePasswords(rotatedPW)
	for _, p := range []*proc{repl, onch} {
		p.signal(t, syscall.SIGHUP)
	}
	waitFor(t, 10*time.Second, "both consumers reloaded the passwords file", procs, func() bool {
		return strings.Contains(repl.out.String(), "passwords file reloaded") && strings.Contains(onch.out.String(), "passwords file reloaded")
	})
	cs.Put(t, sources[0], "after_reload", map[string]any{"n": 99})
	waitFor(t, 30*time.Second, "a webhook call with the rotated password, and its replication", procs, func() bool {
		for _, c := range goodCalls(sink.all(), srcPrefix, rotatedPW, hmacKey) {
			if c.bodyHas(`"after_reload"`) {
				return len(docIDs(t, cs, "n_"+sources[0])) == 4
			}
		}
		return false
	})
	quoted, err := json.Marshal(brokenPW)
	require.NoError(t, err)
	writeFile([]byte(`{"` + hostPort(sink.Server) + `": {"hook": ` + string(quoted) + `}, "127.0.0.1": {"hook": `))
	for _, p := range []*proc{repl, onch} {
		p.signal(t, syscall.SIGHUP)
	}
	waitFor(t, 10*time.Second, "both consumers refused the broken passwords file", procs, func() bool {
		const msg = "keeping the previous passwords"
		return strings.Contains(repl.out.String(), msg) && strings.Contains(onch.out.String(), msg)
	})

	// Everything else the run shows.
	for _, args := range [][]string{{"status"}, {"status", "--json"}, {"--help"}, {"status", "--help"}, {"--version"}} {
		out, code := runCmd(t, bin("producer"), producerEnv, args...)
		collect("producer "+strings.Join(args, " "), out)
		assert.Equal(t, 0, code, "producer %v:\n%s", args, out)
		if args[0] == "status" && len(args) == 1 {
			for _, id := range []string{"bad_hook_rule", "bad_replicator_rule"} {
				assert.Contains(t, out, id, "producer status does not list the rejected rule")
			}
			assert.Contains(t, out, "password in URL")
		}
	}
	for _, b := range []struct {
		name string
		env  []string
	}{{"replicator", replicatorEnv}, {"onchange", onchangeEnv}} {
		out, code := runCmd(t, bin(b.name), b.env, "--help")
		collect(b.name+" --help", out)
		assert.Equal(t, 0, code, "%s --help:\n%s", b.name, out)
	}
	// What `nats micro list/info/stats` and the status endpoints answer (the per-rule last
	// errors of refused replications and given-up webhook calls among them).
	for _, subject := range []string{"$SRV.PING", "$SRV.INFO", "$SRV.STATS"} {
		answers := natstest.Answers(t, nc, subject, len(procs), 3*time.Second)
		assert.Len(t, answers, len(procs), subject)
		for i, a := range answers {
			collect(fmt.Sprintf("NATS %s answer %d", subject, i), string(a))
		}
	}
	for _, c := range []string{"producer", "replicator", "onchange"} {
		subject := subjectPrefix + ".svc." + c + ".status"
		answers := natstest.Answers(t, nc, subject, 1, 3*time.Second)
		assert.Len(t, answers, 1, subject)
		for _, a := range answers {
			collect("NATS "+subject+" answer", string(a))
		}
	}
	for _, p := range procs {
		for _, path := range []string{"/metrics", "/readyz", "/healthz"} {
			code, body := p.get(path)
			assert.Equal(t, http.StatusOK, code, "%s %s", p.name, path)
			collect(p.name+" "+path, body)
		}
	}
	for _, stream := range []string{"_DEADLETTER", "_CHANGES"} {
		for _, m := range streamMessages(t, js, streamBase+stream) {
			collect(fmt.Sprintf("stream %s%s message %d (%s)", streamBase, stream, m.Sequence, m.Subject), fmt.Sprintf("%v\n%s", m.Header, m.Data))
		}
	}

	writePasswords(rotatedPW) // repaired, so that the runs below fail where they are meant to

	// Refused credentials: the error each process prints must not quote them.
	wrongCouchURL := (&url.URL{Scheme: "http", User: url.UserPassword("admin", wrongCouchPW), Host: hostPort(couchProxy.Server)}).String()
	natsHost := strings.TrimPrefix(ns.URL(), "nats://")
	wrongNatsURL := (&url.URL{Scheme: "nats", User: url.UserPassword("spiegel", wrongNatsPW), Host: natsHost}).String()
	for _, f := range []struct {
		name, bin string
		env       []string
		args      []string
		want      string // the refusal the output must report
	}{
		{"producer status with a wrong CouchDB password", "producer", with(producerEnv, "SPIEGEL_COUCHDB_URL="+wrongCouchURL),
			[]string{"status"}, "401"},
		{"onchange with a wrong CouchDB password", "onchange", with(onchangeEnv, "SPIEGEL_COUCHDB_URL="+wrongCouchURL, "SPIEGEL_HTTP_ADDR="),
			nil, "401"},
		{"replicator with a wrong NATS password", "replicator", with(replicatorEnv, "SPIEGEL_NATS_PASSWORD="+wrongNatsPW, "SPIEGEL_HTTP_ADDR="),
			nil, "Authorization Violation"},
		{"producer status with a wrong NATS password in the URL", "producer",
			with(producerEnv, "SPIEGEL_NATS_URL="+wrongNatsURL, "SPIEGEL_NATS_USER=", "SPIEGEL_NATS_PASSWORD="), []string{"status"}, "Authorization Violation"},
	} {
		out, code := runCmd(t, bin(f.bin), f.env, f.args...)
		collect(f.name, out)
		assert.NotEqual(t, 0, code, "%s: exit status 0:\n%s", f.name, out)
		assert.Contains(t, out, f.want, f.name)
	}
	assert.True(t, couchProxy.sawRefused("admin:"+wrongCouchPW), "the wrong CouchDB password was never sent")

	// SIGTERM stops every process cleanly; what they print while stopping counts too.
	for _, p := range slices.Backward(procs) {
		stopping := time.Now()
		assert.NoError(t, p.stop(20*time.Second), "%s exit", p.name)
		t.Logf("%-70s %s", p.name+" stopped on SIGTERM", time.Since(stopping).Round(10*time.Millisecond))
	}
	for _, p := range procs {
		collect(p.name+" output (stdout and stderr)", p.out.String())
	}
	for _, want := range []struct {
		proc *proc
		text string
	}{
		{prod, "bad_hook_rule"}, {repl, "bad_replicator_rule"}, {onch, "bad_hook_rule"}, {repl, "replicated"},
		{repl, "replication failed permanently"},
	} {
		assert.Contains(t, want.proc.out.String(), want.text, "%s output", want.proc.name)
	}

	// No secret, in any form, in any output.
	if dir := os.Getenv("E2E_DUMP_DIR"); dir != "" { // to read what was checked
		for i, o := range outs {
			_ = os.WriteFile(filepath.Join(dir, fmt.Sprintf("%02d %s.txt", i, strings.ReplaceAll(o.Name, "/", "_"))), []byte(o.Text), 0o644)
		}
	}
	leaks := findLeaks(outs, secrets)
	for _, l := range leaks {
		t.Errorf("LEAK: %s shows the %s (%s form):\n…%s…", l.output, l.secret, l.kind, l.context)
	}
	var total int
	for _, o := range outs {
		total += len(o.Text)
	}
	t.Logf("checked %d secrets in %d outputs (%d bytes) in %s; %d leaks", len(secrets), len(outs), total,
		time.Since(started).Round(100*time.Millisecond), len(leaks))
}
