package e2e

import (
	"net"
	"net/http"
	"net/url"
	"testing"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// startReplicatorJobs puts one continuous _replicator job per user db into target. When the
// server is on this machine, the jobs reach it through a counting proxy, returned by the name
// "_replicator"; otherwise (it could not reach the proxy) they use the server's URL and no
// proxy is returned.
func startReplicatorJobs(b *testing.B, cs *couchtest.Server, users []string, target string) map[string]*countingProxy {
	b.Helper()
	base := cs.URL
	var proxies map[string]*countingProxy
	if u, err := url.Parse(cs.URL); err == nil && isLoopback(u.Hostname()) {
		p := newCountingProxy(b, cs.URL, "")
		proxies = map[string]*countingProxy{"_replicator": p}
		base = p.urlFor(cs.URL)
	}
	for _, db := range users {
		doc := map[string]any{"source": base + "/" + couchtest.PathDB(db), "target": base + "/" + couchtest.PathDB(target), "continuous": true}
		id := "bench_" + db
		cs.Put(b, "_replicator", id, doc)
		b.Cleanup(func() { deleteReplicatorJob(b, cs, id) })
	}
	return proxies
}

// stopReplicatorJobs deletes the jobs of startReplicatorJobs, so that they do not run on under
// the next setup.
func stopReplicatorJobs(b *testing.B, cs *couchtest.Server, users []string) {
	for _, db := range users {
		deleteReplicatorJob(b, cs, "bench_"+db)
	}
}

func deleteReplicatorJob(b *testing.B, cs *couchtest.Server, id string) {
	var cur struct {
		Rev string `json:"_rev"`
	}
	if cs.Do(b, http.MethodGet, "/_replicator/"+id, nil, &cur) == nil {
		_ = cs.Do(b, http.MethodDelete, "/_replicator/"+id+"?rev="+cur.Rev, nil, nil)
	}
}

func isLoopback(host string) bool {
	ip := net.ParseIP(host)
	return host == "localhost" || (ip != nil && ip.IsLoopback())
}
