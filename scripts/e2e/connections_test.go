package e2e

import (
	"cmp"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// BenchmarkConnections measures what CouchDB connections a fleet holds when many dbs change once
// each: N user dbs (BENCH_CONN_DBS, 400) of one doc, a pattern replicator rule fanning them into
// one target and an on_change rule calling a local webhook, one producer, two replicators and
// two onchange processes (the real binaries). After the initial sync, one doc is written to
// each db (8 writers); the run ends when every doc is on the target and at the webhook.
//
// The five processes talk to CouchDB directly (through the test's _db_updates proxy on PouchDB
// Server, which batches for 500 ms as CouchDB 3 does), and their ESTABLISHED TCP connections
// to it are counted from /proc every 100 ms. It reports the peak of the five together during
// the initial sync and during the writes, the producer's peak, and hot feeds opened per
// written doc (the producer's spiegel_hot_feeds_opened_total). BENCH_CONN_VARS adds SPIEGEL_
// variables to every process (comma-separated, e.g. SPIEGEL_HOT_FEEDS=0); BENCH_BIN_DIR runs the
// binaries of another build (bin/ by default), to compare; BENCH_REPORT_DIR gets connections.md.
func BenchmarkConnections(b *testing.B) {
	root := repoRoot(b, "producer", "replicator", "onchange")
	cs := couchtest.Get(b)
	n := 400
	if v := os.Getenv("BENCH_CONN_DBS"); v != "" {
		x, err := strconv.Atoi(v)
		if err != nil || x < 1 {
			b.Fatalf("BENCH_CONN_DBS=%q: want a number of dbs", v)
		}
		n = x
	}
	var vars []string
	if v := os.Getenv("BENCH_CONN_VARS"); v != "" {
		vars = strings.Split(v, ",")
	}
	var r connResult
	for range b.N {
		r = runConnections(b, root, cs, n, vars)
	}
	b.ReportMetric(float64(r.syncPeak), "conns-sync-peak")
	b.ReportMetric(float64(r.writePeak), "conns-write-peak")
	b.ReportMetric(float64(r.producerPeak), "producer-conns-peak")
	b.ReportMetric(r.feedsPerDoc, "hot-feeds/doc")
	b.Logf("%d dbs, one write each (%s): CouchDB connections of the five processes, peak during the initial sync %d, "+
		"during the writes %d (producer %d, by process %v); hot feeds opened %.0f (%.3f per written doc); writes delivered in %v",
		n, cmp.Or(strings.Join(vars, " "), "defaults"), r.syncPeak, r.writePeak, r.producerPeak, r.byProcess, r.feedsOpened, r.feedsPerDoc, r.deliveredIn)
	if dir := os.Getenv("BENCH_REPORT_DIR"); dir != "" {
		md := fmt.Sprintf("# CouchDB connections, %d dbs written once each\n\nServer: %s. Settings: %s.\n\n"+
			"| figure | value |\n|---|---|\n| peak connections of the 5 processes, initial sync | %d |\n"+
			"| peak connections of the 5 processes, writes | %d |\n| producer's peak | %d |\n| peak by process (writes) | %v |\n"+
			"| hot feeds opened | %.0f (%.3f per written doc) |\n| all writes delivered in | %v |\n",
			n, serverName(cs), cmp.Or(strings.Join(vars, " "), "defaults"), r.syncPeak, r.writePeak, r.producerPeak, r.byProcess,
			r.feedsOpened, r.feedsPerDoc, r.deliveredIn.Round(time.Millisecond))
		if err := os.WriteFile(filepath.Join(dir, "connections.md"), []byte(md), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

type connResult struct {
	syncPeak, writePeak, producerPeak int
	byProcess                         map[string]int
	feedsOpened, feedsPerDoc          float64
	deliveredIn                       time.Duration
}

func runConnections(b *testing.B, root string, cs *couchtest.Server, n int, vars []string) connResult {
	b.Helper()
	up := cs.NewUpdatesProxy(b, couchtest.CoalesceWindow(500*time.Millisecond))
	writer := up.Server()
	prefix := couchtest.UniqueName(b, "conn_") + "_"
	target, spiegelDB := prefix+"target", prefix+"spiegel"
	users := make([]string, n)
	cs.CreateDB(b, target)
	for i := range users {
		users[i] = fmt.Sprintf("%su%05d", prefix, i)
		cs.CreateDB(b, users[i])
		writer.Put(b, users[i], fmt.Sprintf("init%05d", i), map[string]any{"n": i})
	}
	sink := newLatencySink(b)
	ns := natstest.Start(b)
	up.Server().Cleanup(b, spiegelDB)
	u, err := url.Parse(up.URL())
	if err != nil {
		b.Fatal(err)
	}
	port, _ := strconv.Atoi(u.Port())
	env := baseEnv(append([]string{"SPIEGEL_COUCHDB_URL=" + up.URL(), "SPIEGEL_DB_NAME=" + spiegelDB, "SPIEGEL_NATS_URL=" + ns.URL(),
		"SPIEGEL_LOG_LEVEL=warn"}, vars...)...)
	binDir := cmp.Or(os.Getenv("BENCH_BIN_DIR"), filepath.Join(root, "bin"))
	bin := func(name string) string { return filepath.Join(binDir, name) }
	if out, code := runCmd(b, bin("producer"), env, "install"); code != 0 {
		b.Fatalf("producer install:\n%s", out)
	}
	pattern := "^" + prefix + "u"
	writer.Put(b, spiegelDB, "fan_in", map[string]any{"type": "replicator", "db_name": pattern, "source": "$db_name", "target": target})
	writer.Put(b, spiegelDB, "hook", map[string]any{"type": "on_change", "db_name": pattern, "url": sink.URL + "/hook",
		"params": map[string]any{"id": "$change.id"}})

	var procs []*proc
	for _, name := range []string{"producer", "replicator", "replicator", "onchange", "onchange"} {
		addr := freeAddr(b)
		procs = append(procs, startProc(b, fmt.Sprintf("%s-%d", name, len(procs)), bin(name), addr, append(env, "SPIEGEL_HTTP_ADDR="+addr)))
	}
	var mu sync.Mutex
	peak, phase := map[string]int{}, "sync"
	byProcess := map[string]int{}
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			total := 0
			mu.Lock()
			for _, p := range procs {
				if st, err := readProc(p.cmd.Process.Pid, port); err == nil {
					total += st.CouchConns
					if phase == "write" {
						byProcess[p.name] = max(byProcess[p.name], st.CouchConns)
					}
				}
			}
			peak[phase] = max(peak[phase], total)
			mu.Unlock()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	for _, p := range procs {
		waitFor(b, 60*time.Second, p.name+" ready", procs, func() bool { code, _ := p.get("/readyz"); return code == http.StatusOK })
	}
	waitFor(b, 10*time.Minute, "initial sync", procs, func() bool { return docCount(b, cs, target) >= n && sink.distinct() >= n })

	mu.Lock()
	phase = "write"
	mu.Unlock()
	start := time.Now()
	var wg sync.WaitGroup
	work := make(chan int)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				writer.Put(b, users[i], fmt.Sprintf("once%05d", i), map[string]any{"n": i})
			}
		}()
	}
	for i := range users {
		work <- i
	}
	close(work)
	wg.Wait()
	waitFor(b, 10*time.Minute, "the writes delivered", procs, func() bool { return docCount(b, cs, target) >= 2*n && sink.distinct() >= 2*n })
	delivered := time.Since(start)
	// Feeds that opened stay until idle: keep sampling a little longer than that.
	time.Sleep(3 * time.Second)
	close(stop)
	<-sampled

	opened := healthtest.Scrape(b, procs[0].addr).Get("spiegel_hot_feeds_opened_total")
	for _, p := range procs {
		_ = p.stop(20 * time.Second)
	}
	mu.Lock()
	defer mu.Unlock()
	return connResult{syncPeak: peak["sync"], writePeak: peak["write"], producerPeak: byProcess[procs[0].name], byProcess: byProcess,
		feedsOpened: opened, feedsPerDoc: opened / float64(n), deliveredIn: delivered}
}
