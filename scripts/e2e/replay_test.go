package e2e

import (
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// changeMsg is one message of a subject rule's stream: its message id and replay header.
type changeMsg struct{ id, replay string }

// TestReplaySubjectRule: `producer replay` on a subject rule stores the rule's history in the
// stream again, under the replay's id, and prints per db how many changes it re-dispatched: 3
// changes make 6 messages after a replay, 9 after a second one. The same replay run twice at
// once, then once more (--id), stores nothing twice.
func TestReplaySubjectRule(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the pipeline")
	}
	root := repoRoot(t, "producer", "onchange")
	bin := func(name string) string { return filepath.Join(root, "bin", name) }
	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	_, js := ns.Connect(t)

	spiegelDB := couchtest.UniqueName(t, "e2e_rp_spiegel_")
	src := couchtest.UniqueName(t, "e2e_rp_src_")
	cs.Cleanup(t, spiegelDB) // made by `producer install`
	cs.Cleanup(t, src)
	env := baseEnv(
		"SPIEGEL_COUCHDB_URL="+cs.URL, "SPIEGEL_DB_NAME="+spiegelDB, "SPIEGEL_NATS_URL="+ns.URL(),
		"SPIEGEL_SUBJECT_PREFIX=e2erp", "SPIEGEL_POLL_INTERVAL=200ms", "SPIEGEL_RETRY_INITIAL=200ms",
		"SPIEGEL_RETRY_MAX=1s",
	)
	with := func(extra ...string) []string { return append(slices.Clone(env), extra...) }
	admin := func(args ...string) string {
		t.Helper()
		stdout, stderr, code := runCmdIO(t, bin("producer"), env, "", args...)
		require.Equal(t, 0, code, "producer %s:\n%s%s", strings.Join(args, " "), stdout, stderr)
		return stdout
	}
	admin("install")
	cs.Put(t, spiegelDB, "pub", map[string]any{"type": "on_change", "db_name": "^" + src + "$", "subject": "e2erp.changes.${db_name}"})

	addrs := []string{freeAddr(t), freeAddr(t)}
	procs := []*proc{
		startProc(t, "producer", bin("producer"), addrs[0], with("SPIEGEL_HTTP_ADDR="+addrs[0])),
		startProc(t, "onchange", bin("onchange"), addrs[1], with("SPIEGEL_HTTP_ADDR="+addrs[1])),
	}
	for _, p := range procs {
		waitFor(t, 30*time.Second, p.name+" ready", procs, func() bool { code, _ := p.get("/readyz"); return code == http.StatusOK })
	}
	cs.CreateDB(t, src)
	for _, id := range []string{"d1", "d2", "d3"} {
		cs.Put(t, src, id, map[string]any{"v": id})
	}
	msgs := func() []changeMsg {
		st, err := js.Stream(t.Context(), "E2ERP_CHANGES")
		require.NoError(t, err)
		info, err := st.Info(t.Context())
		require.NoError(t, err)
		var out []changeMsg
		for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
			m, err := st.GetMsg(t.Context(), seq)
			require.NoError(t, err)
			out = append(out, changeMsg{m.Header.Get(jetstream.MsgIDHeader), m.Header.Get("Spiegel-Replay")})
		}
		return out
	}
	waitFor(t, 60*time.Second, "3 changes in the stream", procs, func() bool { return len(msgs()) == 3 })

	counted := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(src) + `\s+done\s+(\d+)\s*$`)
	replay := func(args ...string) string {
		t.Helper()
		out := admin(append([]string{"replay", "--rule", "pub", "--wait", "60s"}, args...)...)
		m := counted.FindStringSubmatch(out)
		require.NotNil(t, m, "per-db count in:\n%s", out)
		assert.Equal(t, "3", m[1], "3 changes re-dispatched:\n%s", out)
		return out
	}
	replay()
	assert.Len(t, msgs(), 6, "a replay stores the history again")
	replay()
	all := msgs()
	require.Len(t, all, 9, "and again")
	replays := map[string][]string{}
	for i, m := range all {
		if i < 3 {
			assert.Empty(t, m.replay, "first publications carry no replay header")
			continue
		}
		require.NotEmpty(t, m.replay, "a replayed message names its replay")
		assert.True(t, strings.HasPrefix(m.id, "replay/"+m.replay+"/"+src+"/"), m.id)
		replays[m.replay] = append(replays[m.replay], m.id)
	}
	require.Len(t, replays, 2, "two replays, each with its own id")
	for id, ids := range replays {
		assert.Len(t, ids, 3, "replay %s stored each change once", id)
	}

	// The same replay, twice at once, then once more: its changes are stored once.
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { replay("--id", "again-1") })
	}
	wg.Wait()
	replay("--id", "again-1")
	var again []string
	for _, m := range msgs() {
		if m.replay == "again-1" {
			again = append(again, m.id)
		}
	}
	assert.Len(t, msgs(), 12)
	// Each change once. (Their order is the feed's, which on a sharded CouchDB db need not be
	// the order of the writes: the publish tests and the chaos run check the order.)
	assert.ElementsMatch(t, []string{"replay/again-1/" + src + "/d1/", "replay/again-1/" + src + "/d2/", "replay/again-1/" + src + "/d3/"},
		trimRevs(again), "each change once")
}

// trimRevs cuts the rev off message ids <...>/<doc>/<rev>.
func trimRevs(ids []string) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id[:strings.LastIndex(id, "/")+1]
	}
	return out
}
