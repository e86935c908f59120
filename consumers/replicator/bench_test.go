package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// BenchmarkReplicationLatency runs the whole pipeline as real processes (producer binary and
// replicator process) against the test server: SPIEGEL_BENCH_DBS dbs (default 100) under one
// pattern rule into one target, 10% of them written at a steady SPIEGEL_BENCH_RATE writes/s
// (default 20) for SPIEGEL_BENCH_SECONDS (default 20). It reports write → visible-in-target
// latency percentiles, replications per write, and the TCP connections the two processes hold
// to CouchDB (sampled from /proc every 250ms). SPIEGEL_BENCH_REPORT names a file to append a
// markdown report to; SPIEGEL_BENCH_LOG a file for the replicator's info logs. It runs once
// whatever b.N is.
//
//	go test -run x -bench ReplicationLatency -benchtime 1x ./consumers/replicator
//
// It runs once per engine of SPIEGEL_BENCH_ENGINES (default "couchdb,native"), each with its
// own dbs, so the two are measured on the same server in the same run.
func BenchmarkReplicationLatency(b *testing.B) {
	engines := strings.Split(os.Getenv("SPIEGEL_BENCH_ENGINES"), ",")
	if os.Getenv("SPIEGEL_BENCH_ENGINES") == "" {
		engines = []string{"couchdb", "native"}
	}
	for _, engine := range engines {
		b.Run("engine="+engine, func(b *testing.B) { benchLatency(b, strings.TrimSpace(engine)) })
	}
}

func benchLatency(b *testing.B, engine string) {
	dbs, rate, secs := envInt("SPIEGEL_BENCH_DBS", 100), envInt("SPIEGEL_BENCH_RATE", 20), envInt("SPIEGEL_BENCH_SECONDS", 20)
	e := newEnv(b, 30*time.Second)
	target := e.Prefix + "all"
	e.Couch.CreateDB(b, target)
	names := make([]string, dbs)
	for i := range names {
		names[i] = fmt.Sprintf("%sb_%05d", e.Prefix, i)
		e.Couch.CreateDB(b, names[i])
	}
	e.Couch.Put(b, e.cfg.DBName, "bench", map[string]any{"type": "replicator", "db_name": "^" + e.Prefix + `b_\d+$`, "source": "$db_name", "target": target})
	metricsAddr := freeAddr(b)
	replLogs, level := &syncBuffer{}, "warn"
	if os.Getenv("SPIEGEL_BENCH_LOG") != "" {
		level = "info"
	}
	repl := e.startProcess(b, e.Couch.URL, replLogs, "SPIEGEL_HTTP_ADDR="+metricsAddr, "SPIEGEL_LOG_LEVEL="+level,
		"SPIEGEL_CONCURRENCY=20", "SPIEGEL_REPLICATION_ENGINE="+engine)
	prod := e.startProducer(b)
	serverPort := portOf(b, e.Couch.URL)
	pids := []int{repl.Process.Pid, prod.Process.Pid}

	// Settle: the new rule's first replication of every db.
	require.Eventually(b, func() bool { return replications(metricsAddr) >= float64(dbs) }, 5*time.Minute, 250*time.Millisecond)
	time.Sleep(2 * time.Second)
	before := replications(metricsAddr)

	seen := newVisibility(e, target)
	stopSeen := seen.follow(b)
	var connSamples []int
	stopConns := sample(250*time.Millisecond, func() { connSamples = append(connSamples, tcpConns(pids, serverPort)) })

	active := names[:max(1, dbs/10)]
	written := map[string]time.Time{}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	b.ResetTimer()
	for i := 0; i < rate*secs; i++ {
		<-tick.C
		db := active[i%len(active)]
		id := fmt.Sprintf("%s_w%06d", db[len(e.Prefix):], i)
		written[id] = time.Now()
		e.Couch.Put(b, db, id, map[string]any{"i": i})
	}
	tick.Stop()
	require.Eventually(b, func() bool { return seen.count(written) == len(written) }, 2*time.Minute, 100*time.Millisecond)
	b.StopTimer()
	stopConns()
	stopSeen()
	time.Sleep(2 * time.Second)
	reps := replications(metricsAddr) - before

	lat := seen.latencies(written)
	p50, p95, p99 := pct(lat, 50), pct(lat, 95), pct(lat, 99)
	maxConns, meanConns := stats(connSamples)
	b.ReportMetric(p50.Seconds()*1000, "p50-ms")
	b.ReportMetric(p95.Seconds()*1000, "p95-ms")
	b.ReportMetric(p99.Seconds()*1000, "p99-ms")
	b.ReportMetric(reps/float64(len(written)), "replications/write")
	b.ReportMetric(float64(maxConns), "max-conns")
	b.ReportMetric(meanConns, "mean-conns")
	report := fmt.Sprintf("| %s | %d dbs | %d active | %d writes/s × %ds | p50 %s | p95 %s | p99 %s | %.0f replications, %.3f per write | conns max %d, mean %.1f |\n",
		engine, dbs, len(active), rate, secs, p50.Round(time.Millisecond), p95.Round(time.Millisecond), p99.Round(time.Millisecond), reps, reps/float64(len(written)), maxConns, meanConns)
	b.Log(report)
	if path := os.Getenv("SPIEGEL_BENCH_LOG"); path != "" {
		require.NoError(b, os.WriteFile(path, []byte(replLogs.String()), 0o644))
	}
	if path := os.Getenv("SPIEGEL_BENCH_REPORT"); path != "" {
		f, err := os.OpenFile(filepath.Clean(path), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		require.NoError(b, err)
		_, _ = f.WriteString(report)
		_ = f.Close()
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func freeAddr(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}

func portOf(t testing.TB, raw string) int {
	u, err := url.Parse(raw)
	require.NoError(t, err)
	p, err := strconv.Atoi(u.Port())
	require.NoError(t, err)
	return p
}

var replicationsRE = regexp.MustCompile(`(?m)^spiegel_replications_total\{engine="[a-z]+",result="ok"\} (\S+)$`)

// replications reads the replicator process's count of successful replications.
func replications(addr string) float64 {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	m := replicationsRE.FindSubmatch(data)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// visibility records when each doc id first shows in the target's _changes.
type visibility struct {
	e      *env
	target string
	mu     sync.Mutex
	at     map[string]time.Time
}

func newVisibility(e *env, target string) *visibility {
	return &visibility{e: e, target: target, at: map[string]time.Time{}}
}

func (v *visibility) follow(t testing.TB) (stop func()) {
	since := "0"
	return sample(20*time.Millisecond, func() {
		var page struct {
			Results []struct {
				ID string `json:"id"`
			} `json:"results"`
			LastSeq any `json:"last_seq"`
		}
		if v.e.Couch.Do(t, http.MethodGet, "/"+escapeDBName(v.target)+"/_changes?since="+url.QueryEscape(since), nil, &page) != nil {
			return
		}
		now := time.Now()
		v.mu.Lock()
		for _, r := range page.Results {
			if _, ok := v.at[r.ID]; !ok {
				v.at[r.ID] = now
			}
		}
		v.mu.Unlock()
		if s, ok := page.LastSeq.(string); ok {
			since = s
		} else if page.LastSeq != nil {
			since = fmt.Sprint(page.LastSeq)
		}
	})
}

func (v *visibility) count(written map[string]time.Time) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	n := 0
	for id := range written {
		if _, ok := v.at[id]; ok {
			n++
		}
	}
	return n
}

func (v *visibility) latencies(written map[string]time.Time) []time.Duration {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []time.Duration
	for id, w := range written {
		if at, ok := v.at[id]; ok {
			out = append(out, at.Sub(w))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func pct(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, len(sorted)*p/100)]
}

func stats(xs []int) (int, float64) {
	m, sum := 0, 0
	for _, x := range xs {
		m, sum = max(m, x), sum+x
	}
	if len(xs) == 0 {
		return 0, 0
	}
	return m, float64(sum) / float64(len(xs))
}

// sample calls fn every d until stop is called; stop waits for the last call.
func sample(d time.Duration, fn func()) (stop func()) {
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(d)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				fn()
			}
		}
	}()
	return func() { close(done); <-finished }
}

// tcpConns counts the established TCP connections of the processes pids to port on loopback,
// from /proc/<pid>/fd and /proc/net/tcp{,6}.
func tcpConns(pids []int, port int) int {
	inodes := map[string]bool{}
	for _, pid := range pids {
		dir := fmt.Sprintf("/proc/%d/fd", pid)
		ents, _ := os.ReadDir(dir)
		for _, ent := range ents {
			link, err := os.Readlink(filepath.Join(dir, ent.Name()))
			if err == nil && strings.HasPrefix(link, "socket:[") {
				inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] = true
			}
		}
	}
	want := fmt.Sprintf(":%04X", port)
	n := 0
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		fh, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) < 10 || fields[3] != "01" || !strings.HasSuffix(fields[2], want) {
				continue
			}
			if inodes[fields[9]] {
				n++
			}
		}
		_ = fh.Close()
	}
	return n
}
