package e2e

import (
	"context"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// sampler looks at a running setup every interval: the pipeline's processes in /proc, the
// JetStream work consumers, and the connections open through each counting proxy.
type sampler struct {
	mu      sync.Mutex
	samples []benchdata.Sample
	done    chan struct{}
}

// startSampler samples until ctx ends; procs (may be none) are matched to proxies by name, js
// may be nil (the baseline has no JetStream). A serverPID above 0 is the CouchDB server's
// process, sampled as "server" (its connections are not counted). Samples are timed from started.
func startSampler(ctx context.Context, started time.Time, interval time.Duration, procs []*proc,
	proxies map[string]*countingProxy, js jetstream.JetStream, serverPID int,
) *sampler {
	s := &sampler{done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			sample := benchdata.Sample{AtS: time.Since(started).Seconds(), ProxyConns: map[string]int{}}
			for name, p := range proxies {
				_, open, _ := p.snapshot(false)
				sample.ProxyConns[name] = open
			}
			if len(procs) > 0 || serverPID > 0 {
				sample.Procs = map[string]benchdata.Proc{}
				if st, err := readProc(serverPID, 0); serverPID > 0 && err == nil {
					st.CouchConns = 0
					sample.Procs["server"] = st
				}
				for _, p := range procs {
					if !p.running() {
						continue
					}
					if st, err := readProc(p.cmd.Process.Pid, proxyPort(proxies[p.name])); err == nil {
						sample.Procs[p.name] = st
					}
				}
			}
			if js != nil {
				sample.Jobs = consumerJobs(ctx, js)
			}
			s.mu.Lock()
			s.samples = append(s.samples, sample)
			s.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return s
}

// snapshot returns the samples so far.
func (s *sampler) snapshot() []benchdata.Sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.samples)
}

// stop waits for the sampler to end (its ctx must be cancelled) and returns its samples.
func (s *sampler) stop() []benchdata.Sample {
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.samples
}

// consumerJobs returns pending and in-flight jobs of every durable consumer of every stream
// (only the work stream has them); none when JetStream does not answer within a second.
func consumerJobs(ctx context.Context, js jetstream.JetStream) map[string]benchdata.Jobs {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	out := map[string]benchdata.Jobs{}
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		st, err := js.Stream(ctx, name)
		if err != nil {
			continue
		}
		infos := st.ListConsumers(ctx)
		for ci := range infos.Info() {
			if ci.Config.Durable == "" {
				continue
			}
			out[ci.Name] = benchdata.Jobs{Pending: ci.NumPending, InFlight: uint64(ci.NumAckPending)}
		}
	}
	return out
}

// proxyPort returns the port a counting proxy listens on (0 for none).
func proxyPort(p *countingProxy) int {
	if p == nil {
		return 0
	}
	u, err := url.Parse(p.URL)
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(u.Port())
	return n
}
