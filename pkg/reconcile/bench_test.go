package reconcile

import (
	"context"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/spiegeltest"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// TestMain reports tests skipped for want of a CouchDB in one line (couchtest.Main).
func TestMain(m *testing.M) { os.Exit(couchtest.Main(m)) }

// BenchmarkJobCost runs jobs one after another through a worker runner whose handler makes one
// CouchDB request (a _changes page that reaches the end of the feed, as a job's read does),
// without ("plain") and with the completion recorder ("recorded"), and reports per job: its
// latency from enqueue to settled (ns/op), the CouchDB requests (the recorder adds none), the
// JetStream API requests beyond the pull, and the JetStream publishes (the record's put).
func BenchmarkJobCost(b *testing.B) {
	for _, recorded := range []bool{false, true} {
		name := "plain"
		if recorded {
			name = "recorded"
		}
		b.Run(name, func(b *testing.B) {
			e := spiegeltest.New(b, spiegeltest.Options{Name: "r", Install: true})
			proxy := e.Couch.NewUpdatesProxy(b)
			db := e.Prefix + "bench"
			e.Couch.CreateDB(b, db)
			e.Couch.Put(b, db, "d", map[string]any{"x": 1})
			cc, err := couch.New(couch.Config{URL: proxy.URL()}, nil)
			require.NoError(b, err)
			done := make(chan struct{}, 1)
			h := func(ctx context.Context, job *worker.Job) error {
				page, err := cc.Changes(ctx, job.DB, couch.ChangesOptions{Limit: 2})
				if err == nil && len(page.Results) < 2 {
					Vouch(ctx, page.LastSeq) // the end of the feed
				}
				return err
			}
			if recorded {
				kv, err := natsjs.DoneBucket(b.Context(), e.JS, natsjs.DefaultTopology(""))
				require.NoError(b, err)
				h = NewRecorder(cc, New(e.JS, kv), e.Logger()).Wrap(h)
			}
			runner, err := worker.New(e.JS, events.NewSubjects(""), worker.Config{Group: rep, Concurrency: 1,
				Observer: observerFunc(func() { done <- struct{}{} })}, h, e.Logger())
			require.NoError(b, err)
			ctx, cancel := context.WithCancel(context.Background())
			stopped := make(chan struct{})
			go func() { defer close(stopped); _ = runner.Run(ctx) }()
			defer func() { cancel(); <-stopped }()

			nc, _ := e.NATS.Connect(b)
			var api, puts atomic.Int64
			_, err = nc.Subscribe("$JS.API.>", func(m *nats.Msg) {
				if !isPull(m.Subject) {
					api.Add(1)
				}
			})
			require.NoError(b, err)
			_, err = nc.Subscribe("$KV.SPIEGEL_DONE.>", func(*nats.Msg) { puts.Add(1) })
			require.NoError(b, err)
			require.NoError(b, nc.Flush())
			gets0 := proxy.Requests(http.MethodGet, "/")
			b.ResetTimer()
			for range b.N {
				e.Enqueue(b, rep, db)
				select {
				case <-done:
				case <-time.After(30 * time.Second):
					b.Fatal("job not done within 30s")
				}
			}
			b.StopTimer()
			require.NoError(b, nc.Flush())
			b.ReportMetric(float64(proxy.Requests(http.MethodGet, "/")-gets0)/float64(b.N), "couch-requests/job")
			b.ReportMetric(float64(api.Load())/float64(b.N), "js-api/job")
			b.ReportMetric(float64(puts.Load())/float64(b.N), "js-publishes/job")
		})
	}
}

// observerFunc calls f after each settled job.
type observerFunc func()

func (f observerFunc) JobDone(events.Group, string, time.Duration) { f() }

func isPull(subject string) bool {
	const next = "$JS.API.CONSUMER.MSG.NEXT."
	return len(subject) >= len(next) && subject[:len(next)] == next
}

// BenchmarkRead reads a bucket of 20,000 records (10,000 dbs, two groups), as every sweep does,
// and reports the time and the records read per second.
func BenchmarkRead(b *testing.B) {
	const dbs = 10_000
	_, js := natstest.Start(b).Connect(b)
	topo := natsjs.DefaultTopology("")
	require.NoError(b, natsjs.EnsureDoneBucket(b.Context(), js, topo))
	kv, err := natsjs.DoneBucket(b.Context(), js, topo)
	require.NoError(b, err)
	r := New(js, kv)
	seq := "12345-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBBFyij"
	for i := range dbs {
		for _, g := range events.Groups {
			_, err := js.PublishAsync("$KV."+kv.Bucket()+"."+Key(g, "user_"+strconv.Itoa(i)), []byte(seq))
			require.NoError(b, err)
		}
		if i%500 == 499 {
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(time.Minute):
				b.Fatal("records not stored")
			}
		}
	}
	b.ResetTimer()
	for range b.N {
		done, err := r.Read(b.Context())
		require.NoError(b, err)
		require.Len(b, done, dbs*len(events.Groups))
	}
	b.ReportMetric(float64(dbs*len(events.Groups)*b.N)/b.Elapsed().Seconds(), "records/s")
}
