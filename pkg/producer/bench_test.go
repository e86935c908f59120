package producer

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/publisher"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// syntheticDBUpdates serves a continuous _db_updates feed of n "updated" events for distinct dbs
// (user_0 … user_n-1), written as fast as the client reads, then heartbeats.
func syntheticDBUpdates(b testing.TB, n int) *httptest.Server {
	var sb strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&sb, `{"db_name":"user_%d","type":"updated","seq":"%d-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBBFyij"}`+"\n", i, i+1)
	}
	body := []byte(sb.String())
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/_db_updates" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(body)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	b.Cleanup(srv.Close)
	return srv
}

func quietLogger() *logrus.Logger {
	l := logrus.New()
	l.SetOutput(os.Stderr)
	l.SetLevel(logrus.ErrorLevel)
	return l
}

// BenchmarkProducerThroughput measures the producer's pipeline — feed parsing, rule matching,
// async publish, in-order settling of the position — against raw JetStream async publishing of
// the same number of jobs, in the same run, into an embedded NATS server. It reports both rates
// and their ratio. SPIEGEL_BENCH_EVENTS sets the events per run (default 100,000), e.g. to
// measure a storage sync (natstest.SyncEnv) that makes every publish slower.
func BenchmarkProducerThroughput(b *testing.B) {
	n := 100_000
	if v := os.Getenv("SPIEGEL_BENCH_EVENTS"); v != "" {
		var err error
		n, err = strconv.Atoi(v)
		require.NoError(b, err, "SPIEGEL_BENCH_EVENTS")
	}
	ns := natstest.Start(b)
	js, err := jetstream.New(mustConn(b, ns), jetstream.WithPublishAsyncMaxPending(4096))
	require.NoError(b, err)
	topo := natsjs.DefaultTopology("")
	require.NoError(b, natsjs.Ensure(context.Background(), js, topo))
	stream, err := js.Stream(context.Background(), topo.Subjects.WorkStream())
	require.NoError(b, err)
	feedSrv := syntheticDBUpdates(b, n)
	set := rules.NewSet()
	_, err = set.Apply("users", []byte(`{"type":"replicator","db_name":"^user_","source":"$db_name","target":"all"}`), false)
	require.NoError(b, err)
	jobs := natsjs.NewJobs(js, topo.Subjects)

	var rawTotal, pipeTotal time.Duration
	for i := 0; i < b.N; i++ {
		require.NoError(b, stream.Purge(context.Background()))
		// Baseline: raw async publish of n jobs to distinct subjects.
		start := time.Now()
		for j := 0; j < n; j++ {
			if _, err := jobs.PublishAsync(events.GroupReplicate, events.Job{DB: fmt.Sprintf("user_%d", j)}); err != nil {
				b.Fatal(err)
			}
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(time.Minute):
			b.Fatal("raw publish did not complete")
		}
		rawTotal += time.Since(start)
		require.NoError(b, stream.Purge(context.Background()))

		// The producer pipeline over the synthetic feed.
		cc, err := couch.New(couch.Config{URL: feedSrv.URL}, quietLogger())
		require.NoError(b, err)
		p := &producer{cfg: producerSettings{SpiegelDB: "spiegel"}, couch: cc, rules: set, log: quietLogger()}
		p.pub = publisher.New(jobs, 2048, nil, p.log)
		ctx, cancel := context.WithCancel(context.Background())
		go p.pub.Run(ctx, time.Second)
		feed, err := cc.NewUpdatesFeed(ctx, couch.SourceDBUpdates, couch.FeedOptions{Heartbeat: 10 * time.Second})
		require.NoError(b, err)
		last := fmt.Sprintf("%d-", n)
		start = time.Now()
		go func() { _ = feed.Run(ctx, "", func(ev couch.DBEvent) error { return p.handle(ctx, ev) }) }()
		for !strings.HasPrefix(p.pub.Safe(), last) {
			time.Sleep(time.Millisecond)
			if time.Since(start) > 2*time.Minute {
				b.Fatal("pipeline did not finish")
			}
		}
		pipeTotal += time.Since(start)
		cancel()
		p.pub.Wait()
	}
	rawRate := float64(n*b.N) / rawTotal.Seconds()
	pipeRate := float64(n*b.N) / pipeTotal.Seconds()
	b.ReportMetric(pipeRate, "events/s")
	b.ReportMetric(rawRate, "raw-publish/s")
	b.ReportMetric(pipeRate/rawRate, "ratio")
}

// BenchmarkProducerMemory reports the heap the producer holds after seeing 100,000 distinct dbs
// (rule-match cache included) — the figure that grows with the number of dbs.
func BenchmarkProducerMemory(b *testing.B) {
	const n = 100_000
	for i := 0; i < b.N; i++ {
		set := rules.NewSet()
		_, err := set.Apply("users", []byte(`{"type":"replicator","db_name":"^user_","source":"$db_name","target":"all"}`), false)
		require.NoError(b, err)
		_, err = set.Apply("hooks", []byte(`{"type":"on_change","db_name":"^user_[0-9]*5$","url":"http://x/"}`), false)
		require.NoError(b, err)
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for j := 0; j < n; j++ {
			_ = set.Groups(fmt.Sprintf("user_%d", j))
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapInuse-before.HeapInuse)/(1<<20), "MiB-heap-per-100k-dbs")
		runtime.KeepAlive(set)
	}
}

func mustConn(b testing.TB, ns *natstest.Server) *nats.Conn {
	nc, _ := ns.Connect(b)
	return nc
}
