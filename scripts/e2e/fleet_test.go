package e2e

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// statusOf is the part of `producer status --json` the fleet test reads.
type statusOf struct {
	Processes []status.Report `json:"processes"`
	PerRule   []struct {
		ID               string   `json:"id"`
		Engine           string   `json:"engine"`
		DBsMatched       int      `json:"dbs_matched"`
		DBsBehind        *int     `json:"dbs_behind"`
		OldestAgeSeconds *float64 `json:"oldest_unprocessed_age_seconds"`
		LastResult       string   `json:"last_result"`
		FailuresLastHour int      `json:"failures_last_hour"`
	} `json:"per_rule"`
}

// TestFleetVisibleInNATS runs two installations on one NATS server — the real producer,
// replicator and onchange binaries of one, a producer and a replicator of another — with a
// known workload: a replicator rule that replicates, an on_change rule whose webhook always
// fails. The NATS micro discovery ($SRV, what `nats micro list/info/stats` read) lists every
// process with its instance id and the build's version; each installation's status endpoints
// and `producer status --json` see their own processes only, with the rules' figures.
func TestFleetVisibleInNATS(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two installations")
	}
	root := repoRoot(t, "producer", "replicator", "onchange")
	bin := func(name string) string { return root + "/bin/" + name }
	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)

	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusInternalServerError)
	}))
	t.Cleanup(failing.Close)

	type installation struct {
		prefix, spiegelDB, dbPrefix string
		env                         []string
		procs                       []*proc
	}
	setup := func(prefix string, components ...string) *installation {
		in := &installation{prefix: prefix, spiegelDB: couchtest.UniqueName(t, "e2e_"+prefix+"_spiegel_"),
			dbPrefix: couchtest.UniqueName(t, "e2e_"+prefix+"_src_") + "_"}
		cs.Cleanup(t, in.spiegelDB)
		in.env = baseEnv("SPIEGEL_COUCHDB_URL="+cs.URL, "SPIEGEL_DB_NAME="+in.spiegelDB, "SPIEGEL_NATS_URL="+ns.URL(),
			"SPIEGEL_SUBJECT_PREFIX="+prefix, "SPIEGEL_POLL_INTERVAL=200ms", "SPIEGEL_RETRY_INITIAL=200ms", "SPIEGEL_RETRY_MAX=2s",
			"SPIEGEL_SHUTDOWN_GRACE=5s")
		out, code := runCmd(t, bin("producer"), in.env, "install")
		require.Equal(t, 0, code, "producer install:\n%s", out)
		pattern := "^" + regexp.QuoteMeta(in.dbPrefix)
		cs.Put(t, in.spiegelDB, "replicate", map[string]any{"type": "replicator", "db_name": pattern, "source": "$db_name",
			"target": "t_${db_name}", "create_target": true})
		cs.Put(t, in.spiegelDB, "hook", map[string]any{"type": "on_change", "db_name": pattern, "url": failing.URL + "/${db_name}",
			"retry": map[string]any{"backoff": "linear", "delay_ms": 20000, "limit": 0}})
		for _, c := range components {
			addr := freeAddr(t)
			in.procs = append(in.procs, startProc(t, prefix+" "+c, bin(c), addr, append(slices.Clone(in.env), "SPIEGEL_HTTP_ADDR="+addr)))
		}
		for _, src := range []string{in.dbPrefix + "a", in.dbPrefix + "b"} {
			cs.Cleanup(t, src)
			cs.Cleanup(t, "t_"+src)
			cs.CreateDB(t, src)
			cs.Put(t, src, "doc", map[string]any{"n": 1})
		}
		return in
	}
	a := setup("fleeta", "producer", "replicator", "onchange")
	b := setup("fleetb", "producer", "replicator")
	all := slices.Concat(a.procs, b.procs)
	for _, p := range all {
		waitFor(t, 30*time.Second, p.name+" ready", all, func() bool { code, _ := p.get("/readyz"); return code == http.StatusOK })
	}

	// `nats micro list`: every process, with its id and the build's version.
	wantNames := []string{"fleeta-onchange", "fleeta-producer", "fleeta-replicator", "fleetb-producer", "fleetb-replicator"}
	var pings []micro.Ping
	waitFor(t, 10*time.Second, "five services answering $SRV.PING", all, func() bool {
		pings = nil
		for _, data := range natstest.Answers(t, nc, "$SRV.PING", len(wantNames), 3*time.Second) {
			var p micro.Ping
			if json.Unmarshal(data, &p) == nil {
				pings = append(pings, p)
			}
		}
		return len(pings) == len(wantNames)
	})
	var names []string
	ids := map[string]bool{}
	for _, p := range pings {
		names = append(names, p.Name)
		ids[p.ID] = true
		assert.NotEmpty(t, p.ID)
		assert.Equal(t, status.SemVer(versionOf(t, bin("producer"))), p.Version)
	}
	slices.Sort(names)
	assert.Equal(t, wantNames, names)
	assert.Len(t, ids, len(wantNames), "instance ids are unique")

	// `nats micro info fleeta-onchange`: the status endpoint on the installation's subject.
	infos := natstest.Answers(t, nc, "$SRV.INFO.fleeta-onchange", 1, 3*time.Second)
	require.Len(t, infos, 1)
	var info micro.Info
	require.NoError(t, json.Unmarshal(infos[0], &info))
	require.Len(t, info.Endpoints, 1)
	assert.Equal(t, "fleeta.svc.onchange.status", info.Endpoints[0].Subject)

	// The replicator's status endpoint answers with the rule's last run; the onchange's with
	// the failing hook's.
	waitFor(t, 60*time.Second, "the replicate rule's run ok and the hook's failure in the status answers", all, func() bool {
		var okRep, failedHook bool
		for _, data := range natstest.Answers(t, nc, "fleeta.svc.replicator.status", 1, 3*time.Second) {
			var rep status.Report
			okRep = json.Unmarshal(data, &rep) == nil && rep.RuleStats["replicate"].LastResult == status.ResultOK
		}
		for _, data := range natstest.Answers(t, nc, "fleeta.svc.onchange.status", 1, 3*time.Second) {
			var rep status.Report
			failedHook = json.Unmarshal(data, &rep) == nil && rep.RuleStats["hook"].FailuresLastHour > 0
		}
		return okRep && failedHook
	})

	// `producer status --json` of each installation: its own processes, and the rules' figures.
	var st statusOf
	waitFor(t, 60*time.Second, "producer status showing the workload", all, func() bool {
		out, code := runCmd(t, bin("producer"), a.env, "status", "--json")
		require.Equal(t, 0, code, "producer status:\n%s", out)
		require.NoError(t, json.Unmarshal([]byte(out), &st), out)
		ok := len(st.PerRule) == 2
		for _, r := range st.PerRule {
			switch r.ID {
			case "replicate":
				ok = ok && r.DBsMatched == 2 && r.LastResult == status.ResultOK
			case "hook":
				ok = ok && r.DBsMatched == 2 && r.DBsBehind != nil && *r.DBsBehind == 2 && r.OldestAgeSeconds != nil &&
					r.LastResult == status.ResultDeferred && r.FailuresLastHour >= 2
			}
		}
		return ok
	})
	var services []string
	for _, p := range st.Processes {
		services = append(services, p.Service)
	}
	assert.Equal(t, []string{"fleeta-producer", "fleeta-replicator", "fleeta-onchange"}, services)
	for _, r := range st.PerRule {
		if r.ID == "replicate" {
			assert.Equal(t, "native (default)", r.Engine)
		}
	}
	out, code := runCmd(t, bin("producer"), b.env, "status", "--json")
	require.Equal(t, 0, code, "producer status:\n%s", out)
	require.NoError(t, json.Unmarshal([]byte(out), &st), out)
	services = nil
	for _, p := range st.Processes {
		services = append(services, p.Service)
	}
	assert.Equal(t, []string{"fleetb-producer", "fleetb-replicator"}, services)

	for _, p := range slices.Backward(all) {
		assert.NoError(t, p.stop(30*time.Second), p.name)
	}
}

// versionOf returns what `<bin> --version` prints after the binary's name.
func versionOf(t testing.TB, bin string) string {
	t.Helper()
	out, code := runCmd(t, bin, baseEnv(), "--version")
	require.Equal(t, 0, code, out)
	m := regexp.MustCompile(`^\S+ (\S+)`).FindStringSubmatch(out)
	require.NotNil(t, m, out)
	return m[1]
}
