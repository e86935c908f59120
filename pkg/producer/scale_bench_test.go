package producer

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/metrics"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/publisher"
	"github.com/spiegel-nats/spiegel/pkg/reconcile"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// Variables of BenchmarkScale.
const (
	// scaleDBsEnv lists the db counts simulated, comma-separated (default scaleDefaultDBs).
	scaleDBsEnv     = "SPIEGEL_SCALE_DBS"
	scaleDefaultDBs = "10000,30000,100000"
	// scaleReportEnv names the JSON file the figures are written to (scripts/benchreport -scale-in
	// draws them); unset, none is written.
	scaleReportEnv = "SPIEGEL_SCALE_REPORT"
	// scaleNATSEnv names a nats-server binary to run as a process of its own (bin/nats-server of
	// `make build`); its memory is then apart from the process's heap and reported as its RSS.
	// Unset, the server is embedded (pkg/natstest) and its memory is part of the heap figures.
	scaleNATSEnv = "SPIEGEL_SCALE_NATS_SERVER"
	// scaleConsumersEnv is the number of consumer processes simulated (runners with their own
	// connections; default 1).
	scaleConsumersEnv = "SPIEGEL_SCALE_CONSUMERS"
	// scaleHeapProfileEnv, when set, is the path prefix of a heap profile written at each moment
	// of the heap figures (<prefix>.published, .settled, .deleted; go tool pprof reads them): what
	// the heap per db is made of.
	scaleHeapProfileEnv = "SPIEGEL_SCALE_HEAP_PROFILE"
)

// The defaults of config.Producer and config.Consumer that the simulation uses.
const (
	scaleMaxInflight = 4096
	scaleHotFeeds    = 32
	scaleHotIdle     = 20 * time.Second
	scaleHeartbeat   = 10 * time.Second
	scaleGrace       = 10 * time.Second
	scaleConcurrency = 20
	scaleAckWait     = 60 * time.Second
)

// scaleRule is the one pattern rule of the simulation: an on_change rule matching every db, so
// that a deleted db takes every path a db leaves behind (its completion records and its cached
// on_change checkpoints). The handler does nothing: the job path is what is measured.
const scaleRule = `{"type":"on_change","db_name":"^db[0-9]+$","url":"http://127.0.0.1:9/"}`

// scaleReport is the JSON file of BenchmarkScale (SPIEGEL_SCALE_REPORT).
type scaleReport struct {
	Machine string       `json:"machine"`
	NATS    string       `json:"nats"` // "embedded" or "process"
	Points  []scalePoint `json:"points"`
}

// scalePoint holds the figures of one db count. Heap figures are runtime.MemStats.HeapInuse (the
// heap's spans in use) and HeapAlloc (its live objects) after a GC, minus the baseline taken once
// the servers ran and the streams were installed, divided by the db count.
type scalePoint struct {
	DBs       int       `json:"dbs"`
	Consumers int       `json:"consumers"`
	LoadAvg   [2]string `json:"load_avg"` // 1-minute load average at start and end

	EventsPerSec float64 `json:"events_per_s"` // feed events in ÷ time until their jobs were acknowledged by JetStream
	JobsPerSec   float64 `json:"jobs_per_s"`   // jobs run through the consumer job path ÷ time until all were acked

	HeapBaseMiB float64 `json:"heap_base_mib"`
	// Heap bytes per db: jobs published (producer holding what it holds after N events; jobs
	// pending in the work stream), settled (every job run, records written), after every db was
	// deleted.
	HeapPerDB map[string]float64 `json:"heap_bytes_per_db"`
	// Live heap bytes per db at the same moments.
	LivePerDB map[string]float64 `json:"live_bytes_per_db"`
	// NATS server RSS in MiB at the start and at the same moments (a server process only).
	NATSRSSMiB map[string]float64 `json:"nats_rss_mib,omitempty"`
	// Goroutines of the process (the fake CouchDB's server side aside) at the start (servers
	// running, streams installed), at the three moments of the heap figures, and once everything
	// stopped.
	Goroutines map[string]int `json:"goroutines"`

	// JetStream API requests per job by kind during the consumer phase, and in all.
	APIPerJob      map[string]float64 `json:"api_per_job"`
	APIPerJobTotal float64            `json:"api_per_job_total"`
	// Other JetStream messages per job of the consumer phase, which are no API requests: acks by
	// body ("+ACK", "+WPI"...), key-value puts by bucket ("$KV.SPIEGEL_DONE"), wakeup markers.
	MsgsPerJob map[string]float64 `json:"msgs_per_job"`
	// JetStream API requests of the producer while it published the N jobs.
	APIProducer map[string]int `json:"api_producer"`

	Sweep   scaleSweep   `json:"sweep"`
	Changed scaleChanged `json:"changed"`
	Delete  scaleDelete  `json:"delete"`
}

// scaleChanged is the phase where a tenth of the dbs change while their job runs: each such db
// gets a wakeup marker, a second run, and its marker deleted.
type scaleChanged struct {
	DBs     int            `json:"dbs"`
	Seconds float64        `json:"seconds"`
	Runs    int64          `json:"runs"`
	API     map[string]int `json:"api"`
	// APIPerDB is the JetStream API requests per changed db, both runs and the producer's offer
	// of the change together.
	APIPerDB    float64 `json:"api_per_db"`
	MarkersLeft uint64  `json:"markers_left"`
	JobsLeft    uint64  `json:"jobs_left"`
}

type scaleSweep struct {
	Seconds  float64          `json:"seconds"`
	API      map[string]int   `json:"api"`
	Couch    map[string]int64 `json:"couch_requests"`
	Enqueued int              `json:"enqueued"`
}

type scaleDelete struct {
	Seconds float64               `json:"seconds"`
	API     map[string]int        `json:"api"`
	Left    map[string]streamLeft `json:"left"` // per stream, once every deleted db is handled
}

type streamLeft struct {
	Msgs     uint64 `json:"msgs"`
	Subjects uint64 `json:"subjects"`
}

// BenchmarkScale simulates N dbs end to end without a CouchDB: the producer engine (feed, rule
// matching, publish pipeline, hot-feed bookkeeping, deleted-db cleanup, sweep) follows a fake
// _db_updates of N distinct dbs (scaleCouch) matched by one pattern rule, into JetStream
// installed as `producer install` installs it; then consumer job paths (worker.Runner under
// reconcile.Recorder.Wrap: a handler that only vouches for the db's seq, the completion record put,
// the wakeup check) run the N jobs; then one sweep runs; then a tenth of the dbs change while
// their job runs (a wakeup marker each, a second run); then every db is deleted. Per N it
// reports events/s, jobs/s, heap per db, goroutines, JetStream API requests per job, per changed
// db and of a sweep, and what is left in NATS (markers, jobs, records) afterwards. SPIEGEL_SCALE_DBS sets the list of N;
// SPIEGEL_SCALE_REPORT a JSON file for scripts/benchreport -scale-in. Run it alone, e.g.
//
//	SPIEGEL_SCALE_DBS=1000 go test -run x -bench Scale -benchtime 1x ./pkg/producer
func BenchmarkScale(b *testing.B) {
	spec := os.Getenv(scaleDBsEnv)
	if spec == "" {
		spec = scaleDefaultDBs
	}
	var sizes []int
	for _, f := range strings.Split(spec, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		require.NoError(b, err, scaleDBsEnv)
		require.Positive(b, n, scaleDBsEnv)
		sizes = append(sizes, n)
	}
	consumers := 1
	if v := os.Getenv(scaleConsumersEnv); v != "" {
		var err error
		consumers, err = strconv.Atoi(v)
		require.NoError(b, err, scaleConsumersEnv)
		require.Positive(b, consumers, scaleConsumersEnv)
	}
	rep := scaleReport{Machine: machine(), NATS: "embedded"}
	if os.Getenv(scaleNATSEnv) != "" {
		rep.NATS = "process"
	}
	for _, n := range sizes {
		b.Run(fmt.Sprintf("dbs=%d", n), func(b *testing.B) {
			var pt scalePoint
			for range b.N {
				pt = runScale(b, n, consumers)
			}
			b.ReportMetric(pt.EventsPerSec, "events/s")
			b.ReportMetric(pt.JobsPerSec, "jobs/s")
			b.ReportMetric(pt.HeapPerDB["published"], "heap-B/db-published")
			b.ReportMetric(pt.HeapPerDB["settled"], "heap-B/db-settled")
			b.ReportMetric(pt.HeapPerDB["deleted"], "heap-B/db-deleted")
			b.ReportMetric(pt.LivePerDB["settled"], "live-B/db-settled")
			b.ReportMetric(pt.LivePerDB["deleted"], "live-B/db-deleted")
			b.ReportMetric(float64(pt.Goroutines["settled"]-pt.Goroutines["start"]), "goroutines-added")
			b.ReportMetric(float64(pt.Goroutines["stopped"]-pt.Goroutines["start"]), "goroutines-left")
			b.ReportMetric(pt.APIPerJobTotal, "api/job")
			b.ReportMetric(pt.Sweep.Seconds, "sweep-s")
			b.ReportMetric(float64(sumCounts(pt.Sweep.API)), "sweep-api")
			left := uint64(0)
			for _, l := range pt.Delete.Left {
				left += l.Msgs
			}
			b.ReportMetric(float64(left), "nats-msgs-left")
			b.ReportMetric(pt.Changed.APIPerDB, "api/changed-db")
			b.ReportMetric(float64(pt.Changed.MarkersLeft), "markers-left")
			rep.Points = slices.DeleteFunc(rep.Points, func(p scalePoint) bool { return p.DBs == n })
			rep.Points = append(rep.Points, pt)
		})
	}
	if path := os.Getenv(scaleReportEnv); path != "" {
		data, err := json.MarshalIndent(rep, "", "  ")
		require.NoError(b, err)
		require.NoError(b, os.WriteFile(path, append(data, '\n'), 0o644))
	}
}

// scaleConsumer is one simulated consumer process: its own NATS connection and CouchDB client, a
// runner of the group's jobs under the completion recorder.
type scaleConsumer struct {
	nc     *nats.Conn
	runner *worker.Runner
	done   chan error
}

// jobCount counts settled jobs by result (worker.Observer).
type jobCount struct{ ok, other atomic.Int64 }

func (c *jobCount) JobDone(_ events.Group, result string, _ time.Duration) {
	if result == worker.ResultOK {
		c.ok.Add(1)
	} else {
		c.other.Add(1)
	}
}

func runScale(b *testing.B, n, consumers int) scalePoint {
	pt := scalePoint{DBs: n, Consumers: consumers, HeapPerDB: map[string]float64{}, LivePerDB: map[string]float64{}, Goroutines: map[string]int{}, NATSRSSMiB: map[string]float64{}}
	pt.LoadAvg[0] = loadAvg()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	natsURL, natsRSS := startScaleNATS(b)
	fake := newScaleCouch(b, n)
	log := quietLogger()
	topo := natsjs.DefaultTopology("")
	topo.AckWait = scaleAckWait
	connect := func(name string) (*nats.Conn, jetstream.JetStream) {
		nc, err := nats.Connect(natsURL, nats.Name(name))
		require.NoError(b, err)
		b.Cleanup(nc.Close)
		js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(2*scaleMaxInflight+64))
		require.NoError(b, err)
		return nc, js
	}
	adminNC, adminJS := connect("admin")
	require.NoError(b, natsjs.Ensure(ctx, adminJS, topo), "install the streams")

	heap := func() (inUse, live float64) {
		runtime.GC()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return float64(ms.HeapInuse), float64(ms.HeapAlloc)
	}
	base, baseLive := heap()
	pt.HeapBaseMiB = base / (1 << 20)
	// The fake CouchDB's side of its connections runs in this process: not counted.
	goroutines := func() int { return runtime.NumGoroutine() - int(fake.conns.Load()) }
	pt.Goroutines["start"] = goroutines()
	if rss := natsRSS(); rss > 0 {
		pt.NATSRSSMiB["start"] = rss
	}
	mark := func(phase string) {
		inUse, live := heap()
		pt.HeapPerDB[phase] = (inUse - base) / float64(n)
		pt.LivePerDB[phase] = (live - baseLive) / float64(n)
		pt.Goroutines[phase] = goroutines()
		if prefix := os.Getenv(scaleHeapProfileEnv); prefix != "" {
			f, err := os.Create(prefix + "." + phase)
			require.NoError(b, err, scaleHeapProfileEnv)
			require.NoError(b, pprof.Lookup("heap").WriteTo(f, 0))
			require.NoError(b, f.Close())
		}
		if rss := natsRSS(); rss > 0 {
			pt.NATSRSSMiB[phase] = rss
		}
	}

	// The producer, wired as Run wires it (no position saves: the fake has no spiegel db).
	pnc, pjs := connect("spiegel-producer")
	cc, err := couch.New(couch.Config{URL: fake.srv.URL}, log)
	require.NoError(b, err)
	set := rules.NewSet()
	_, err = set.Apply("scale", []byte(scaleRule), false)
	require.NoError(b, err)
	pm := metrics.NewProducer(metrics.NewRegistry("producer"))
	p := &producer{
		cfg:   producerSettings{SpiegelDB: "spiegel", Source: couch.SourceDBUpdates, Heartbeat: scaleHeartbeat, Grace: scaleGrace},
		couch: cc, rules: set, log: log, metrics: producerMetrics{m: pm}, resync: make(chan struct{}, 1),
	}
	kv, err := natsjs.OnChangeBucket(ctx, pjs, topo)
	require.NoError(b, err)
	doneKV, err := natsjs.DoneBucket(ctx, pjs, topo)
	require.NoError(b, err)
	dropper, err := checkpoint.NewCacheDropper(ctx, pjs, kv)
	require.NoError(b, err)
	p.deleted = newDeletedDBs(dropper, p.metrics, log)
	records := reconcile.New(pjs, doneKV)
	p.done = &doneRecords{records: records, ensure: func(ctx context.Context) error { return natsjs.EnsureDoneBucket(ctx, pjs, topo) }}
	p.undone = newDeletedDBs(records, producerMetrics{}, log)
	p.changes = &streamWatch{js: pjs, name: topo.Subjects.ChangesStream()}
	p.pub = publisher.New(natsjs.NewJobs(pjs, topo.Subjects), scaleMaxInflight, pm, log)
	p.hot = publisher.NewHotFeeds(cc, p.pub, func(db string) []events.Group { return p.rules.Groups(db).Groups() },
		scaleHotFeeds, scaleHotIdle, scaleHeartbeat, pm, log)

	// Phase 1: the feed's N events become N jobs in the work stream.
	counter := natstest.NewAPICounter(b, natsURL)
	start := time.Now()
	var wg sync.WaitGroup
	run := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); p.pub.Run(ctx, scaleGrace) }()
	run(func() { p.hot.Run(ctx) })
	run(func() { p.deleted.Run(ctx) })
	run(func() { p.undone.Run(ctx) })
	run(func() { p.runFeed(ctx, "") })
	waitUntil(b, "the producer publishes every job", func() bool { return parseSeqNumber(p.pub.Safe()) >= n })
	pt.EventsPerSec = float64(n) / time.Since(start).Seconds()
	pt.APIProducer = counter.Stop(b)
	mark("published")
	work, err := adminJS.Stream(ctx, topo.Subjects.WorkStream())
	require.NoError(b, err)
	info, err := work.Info(ctx)
	require.NoError(b, err)
	require.EqualValues(b, n, info.State.Msgs, "one pending job per db")

	// Phase 2: the consumers run the N jobs.
	var jobs jobCount
	var changing atomic.Bool // phase 4: the first run of a db changes it
	var changedOnce sync.Map // db → its changed run came
	cs := make([]*scaleConsumer, consumers)
	for i := range cs {
		nc, js := connect("spiegel-onchange")
		ccc, err := couch.New(couch.Config{URL: fake.srv.URL}, log)
		require.NoError(b, err)
		ckv, err := natsjs.DoneBucket(ctx, js, topo)
		require.NoError(b, err)
		rec := reconcile.NewRecorder(ccc, reconcile.New(js, ckv), log)
		r, err := worker.New(js, topo.Subjects, worker.Config{
			Group: events.GroupOnChange, Concurrency: scaleConcurrency, AckWait: scaleAckWait, Grace: scaleGrace, Observer: &jobs,
		}, rec.Wrap(func(ctx context.Context, job *worker.Job) error {
			if changing.Load() {
				if _, again := changedOnce.LoadOrStore(job.DB, true); !again {
					// A change lands while the job runs: the producer publishes the db's job, which
					// JetStream refuses as a duplicate, and leaves a wakeup marker.
					return p.pub.EnqueueWait(ctx, job.DB, events.TypeUpdated, []events.Group{events.GroupOnChange})
				}
			}
			if i, ok := fake.index(job.DB); ok {
				reconcile.Vouch(ctx, fake.updSeq[i]) // as a handler whose read reached the feed's end
			}
			return nil
		}), log)
		require.NoError(b, err)
		cs[i] = &scaleConsumer{nc: nc, runner: r, done: make(chan error, 1)}
	}
	counter = natstest.NewAPICounter(b, natsURL)
	traffic := newTrafficCounter(b, natsURL, topo.Subjects.Prefix)
	start = time.Now()
	cctx, stopConsumers := context.WithCancel(ctx)
	defer stopConsumers()
	for _, c := range cs {
		go func() { c.done <- c.runner.Run(cctx) }()
	}
	waitUntil(b, "the consumers run every job", func() bool {
		if jobs.ok.Load() < int64(n) {
			return false
		}
		for _, c := range cs {
			if c.runner.InFlight() > 0 {
				return false
			}
		}
		return true
	})
	pt.JobsPerSec = float64(n) / time.Since(start).Seconds()
	api := counter.Stop(b)
	pt.MsgsPerJob = map[string]float64{}
	for k, v := range traffic.stop(b) {
		pt.MsgsPerJob[k] = float64(v) / float64(n)
	}
	pt.APIPerJob = map[string]float64{}
	for k, v := range api {
		pt.APIPerJob[k] = float64(v) / float64(n)
		pt.APIPerJobTotal += float64(v) / float64(n)
	}
	require.Zero(b, jobs.other.Load(), "every job succeeds")
	info, err = work.Info(ctx)
	require.NoError(b, err)
	require.Zero(b, info.State.Msgs, "the work stream is empty")
	recs, err := records.Read(ctx)
	require.NoError(b, err)
	require.Len(b, recs, n, "one completion record per db")
	mark("settled")

	// Phase 3: one sweep at N; every db is recorded done, so it enqueues nothing.
	counter = natstest.NewAPICounter(b, natsURL)
	before := fake.counts()
	start = time.Now()
	_, err = p.sweepOnce(ctx, nil)
	require.NoError(b, err)
	pt.Sweep.Seconds = time.Since(start).Seconds()
	pt.Sweep.API = counter.Stop(b)
	pt.Sweep.Couch = map[string]int64{}
	for k, v := range fake.counts() {
		if d := v - before[k]; d > 0 {
			pt.Sweep.Couch[k] = d
		}
	}
	pt.Sweep.Enqueued = int(testutil.ToFloat64(pm.SweepEnqueued))

	// Phase 4: a tenth of the dbs change while their job runs. Each gets a wakeup marker, a
	// second run that deletes it, and nothing is left.
	m := max(1, n/10)
	pt.Changed.DBs = m
	counter = natstest.NewAPICounter(b, natsURL)
	runsBefore := jobs.ok.Load()
	changing.Store(true)
	start = time.Now()
	for i := range m {
		require.NoError(b, p.pub.EnqueueNoSeq(ctx, scaleDBName(i), events.TypeUpdated, []events.Group{events.GroupOnChange}))
	}
	wakeups, err := adminJS.Stream(ctx, topo.Subjects.WakeupStream())
	require.NoError(b, err)
	waitUntil(b, "every changed db runs twice and its marker is gone", func() bool {
		if jobs.ok.Load()-runsBefore < int64(2*m) {
			return false
		}
		for _, c := range cs {
			if c.runner.InFlight() > 0 {
				return false
			}
		}
		wi, err := wakeups.Info(ctx)
		return err == nil && wi.State.Msgs == 0
	})
	pt.Changed.Seconds = time.Since(start).Seconds()
	changing.Store(false)
	pt.Changed.API = counter.Stop(b)
	pt.Changed.APIPerDB = float64(sumCounts(pt.Changed.API)) / float64(m)
	pt.Changed.Runs = jobs.ok.Load() - runsBefore
	require.Zero(b, jobs.other.Load(), "every job succeeds")
	wi, err := wakeups.Info(ctx)
	require.NoError(b, err)
	pt.Changed.MarkersLeft = wi.State.Msgs
	info, err = work.Info(ctx)
	require.NoError(b, err)
	pt.Changed.JobsLeft = info.State.Msgs

	// Phase 5: every db is deleted; once the producer handled the events, NATS holds nothing of
	// them.
	counter = natstest.NewAPICounter(b, natsURL)
	start = time.Now()
	fake.deleteAll()
	waitUntil(b, "the producer handles every delete", func() bool {
		return parseSeqNumber(p.pub.Safe()) >= 2*n && p.deleted.Pending() == 0 && p.undone.Pending() == 0
	})
	pt.Delete.Seconds = time.Since(start).Seconds()
	pt.Delete.API = counter.Stop(b)
	pt.Delete.Left = map[string]streamLeft{}
	names := adminJS.StreamNames(ctx)
	for name := range names.Name() {
		s, err := adminJS.Stream(ctx, name)
		require.NoError(b, err)
		si, err := s.Info(ctx)
		require.NoError(b, err)
		pt.Delete.Left[name] = streamLeft{Msgs: si.State.Msgs, Subjects: si.State.NumSubjects}
	}
	require.NoError(b, names.Err())
	mark("deleted")

	// Stop everything; what is left running is a leak.
	stopConsumers()
	for _, c := range cs {
		require.NoError(b, <-c.done)
		c.nc.Close()
	}
	cancel()
	wg.Wait()
	<-pubDone
	pnc.Close()
	adminNC.Close()
	cc.HTTPClient().CloseIdleConnections()
	fake.srv.CloseClientConnections()
	deadline := time.Now().Add(10 * time.Second)
	for goroutines() > pt.Goroutines["start"] && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	pt.Goroutines["stopped"] = goroutines()
	pt.LoadAvg[1] = loadAvg()
	b.Logf("dbs=%d: %.0f events/s, %.0f jobs/s, heap B/db %v, goroutines %v, API/job %v, msgs/job %v, sweep %.2fs %v %v, changed %+v, delete %.2fs %v left %v",
		n, pt.EventsPerSec, pt.JobsPerSec, pt.HeapPerDB, pt.Goroutines, pt.APIPerJob, pt.MsgsPerJob, pt.Sweep.Seconds, pt.Sweep.API, pt.Sweep.Couch,
		pt.Changed, pt.Delete.Seconds, pt.Delete.API, pt.Delete.Left)
	return pt
}

// trafficCounter counts the JetStream messages of the job path that are no API requests: acks
// ($JS.ACK.>, by body), key-value puts ($KV.<bucket>.>, by bucket) and wakeup markers.
type trafficCounter struct {
	nc     *nats.Conn
	mu     sync.Mutex
	counts map[string]int
}

func newTrafficCounter(b *testing.B, url, prefix string) *trafficCounter {
	nc, err := nats.Connect(url)
	require.NoError(b, err)
	b.Cleanup(nc.Close)
	c := &trafficCounter{nc: nc, counts: map[string]int{}}
	count := func(m *nats.Msg) {
		var kind string
		switch {
		case strings.HasPrefix(m.Subject, "$JS.ACK."):
			body, _, _ := strings.Cut(string(m.Data), " ")
			if body == "" {
				body = "+ACK"
			}
			kind = "ACK " + body
		case strings.HasPrefix(m.Subject, "$KV."):
			f := strings.SplitN(m.Subject, ".", 3)
			kind = "KV.PUT " + f[1]
		default:
			kind = "WAKEUP"
		}
		c.mu.Lock()
		c.counts[kind]++
		c.mu.Unlock()
	}
	for _, subj := range []string{"$JS.ACK.>", "$KV.>", prefix + ".wakeup.>"} {
		_, err := nc.Subscribe(subj, count)
		require.NoError(b, err)
	}
	require.NoError(b, nc.Flush())
	return c
}

func (c *trafficCounter) stop(b *testing.B) map[string]int {
	require.NoError(b, c.nc.Flush())
	c.nc.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.counts)
}

// waitUntil waits for cond, failing after ten minutes.
func waitUntil(b *testing.B, what string, cond func() bool) {
	b.Helper()
	deadline := time.Now().Add(10 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			b.Fatalf("%s: not within 10 minutes", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// startScaleNATS starts the simulation's NATS server: the binary SPIEGEL_SCALE_NATS_SERVER names
// as a process of its own (rss returns its resident memory in MiB), or an embedded one (rss
// returns 0).
func startScaleNATS(b *testing.B) (url string, rss func() float64) {
	bin := os.Getenv(scaleNATSEnv)
	if bin == "" {
		ns := natstest.Start(b)
		return ns.URL(), func() float64 { return 0 }
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(b, l.Close())
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", b.TempDir())
	require.NoError(b, cmd.Start(), scaleNATSEnv)
	b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url = fmt.Sprintf("nats://127.0.0.1:%d", port)
	deadline := time.Now().Add(30 * time.Second)
	for {
		nc, err := nats.Connect(url)
		if err == nil {
			nc.Close()
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("nats-server %s did not start: %v", bin, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	pid := cmd.Process.Pid
	return url, func() float64 {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			return 0
		}
		for _, line := range strings.Split(string(data), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseFloat(f[1], 64)
				return kb / 1024
			}
		}
		return 0
	}
}

func loadAvg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	return strings.Fields(string(data))[0]
}

func machine() string {
	return fmt.Sprintf("%d cores (GOMAXPROCS %d), %s %s/%s", runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

func sumCounts(m map[string]int) int {
	s := 0
	for _, v := range m {
		s += v
	}
	return s
}
