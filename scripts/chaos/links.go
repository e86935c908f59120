package chaos

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// links are one product process's own proxies: one to each NATS node (its SPIEGEL_NATS_URL
// lists them) and one to each CouchDB node (its SPIEGEL_COUCHDB_URL lists them). A partition fault freezes or cuts
// them, separating that process, and no other, from NATS or from CouchDB. The NATS nodes do not
// advertise their own addresses to clients (cluster no_advertise), so a client never reaches a
// node around its proxies.
type links struct {
	nats  []*outageProxy
	couch []*outageProxy
}

// startLinks starts the proxies of one process: to every node of c and to every server behind
// couchURL (the URL list the processes would use without links: CouchDB's nodes, or the outage
// proxies of an external server).
func startLinks(c *cluster, couchURL string) (*links, error) {
	l := &links{}
	for _, n := range c.nodes {
		p, err := startOutageProxy(fmt.Sprintf("127.0.0.1:%d", n.client))
		if err != nil {
			l.close()
			return nil, err
		}
		l.nats = append(l.nats, p)
	}
	for _, node := range couch.SplitURLs(couchURL) {
		u, err := url.Parse(node)
		if err != nil {
			l.close()
			return nil, fmt.Errorf("the CouchDB URL does not parse") // never print it: it has the password
		}
		p, err := startOutageProxy(u.Host)
		if err != nil {
			l.close()
			return nil, err
		}
		l.couch = append(l.couch, p)
	}
	return l, nil
}

// env returns SPIEGEL_NATS_URL and SPIEGEL_COUCHDB_URL through the proxies.
func (l *links) env(couchURL string) ([]string, error) {
	var urls []string
	for _, p := range l.nats {
		urls = append(urls, "nats://"+p.addr)
	}
	var cus []string
	for i, node := range couch.SplitURLs(couchURL) {
		cu, err := l.couch[i].url(node)
		if err != nil {
			return nil, err
		}
		cus = append(cus, cu)
	}
	return []string{"SPIEGEL_NATS_URL=" + strings.Join(urls, ","), "SPIEGEL_COUCHDB_URL=" + strings.Join(cus, ",")}, nil
}

// partition freezes (or, with cut, resets) every proxy of ps for down, or until ctx ends. mark
// is called once the partition is in place.
func partition(ctx context.Context, ps []*outageProxy, cut bool, down time.Duration, mark func()) error {
	if !cut {
		for _, p := range ps {
			p.freeze()
		}
		defer func() {
			for _, p := range ps {
				p.thaw()
			}
		}()
		mark()
		return sleepCtx(ctx, down)
	}
	for _, p := range ps {
		p.startCut()
	}
	defer func() {
		for _, p := range ps {
			p.endCut()
		}
	}()
	mark()
	return sleepCtx(ctx, down)
}

// close stops every proxy.
func (l *links) close() {
	if l == nil {
		return
	}
	for _, p := range l.nats {
		p.close()
	}
	for _, p := range l.couch {
		p.close()
	}
}
