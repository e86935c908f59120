package chaos

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"time"
)

// links are one product process's own proxies: one to each NATS node (its SPIEGEL_NATS_URL
// lists them) and one to CouchDB (its SPIEGEL_COUCHDB_URL). A partition fault freezes or cuts
// them, separating that process, and no other, from NATS or from CouchDB. The NATS nodes do not
// advertise their own addresses to clients (cluster no_advertise), so a client never reaches a
// node around its proxies.
type links struct {
	nats  []*outageProxy
	couch *outageProxy
}

// startLinks starts the proxies of one process: to every node of c and to the server behind
// couchURL (the URL the processes would use without links: CouchDB, or the outage proxy of an
// external server).
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
	u, err := url.Parse(couchURL)
	if err != nil {
		l.close()
		return nil, fmt.Errorf("the CouchDB URL does not parse") // never print it: it has the password
	}
	if l.couch, err = startOutageProxy(u.Host); err != nil {
		l.close()
		return nil, err
	}
	return l, nil
}

// env returns SPIEGEL_NATS_URL and SPIEGEL_COUCHDB_URL through the proxies.
func (l *links) env(couchURL string) ([]string, error) {
	var urls []string
	for _, p := range l.nats {
		urls = append(urls, "nats://"+p.addr)
	}
	cu, err := l.couch.url(couchURL)
	if err != nil {
		return nil, err
	}
	return []string{"SPIEGEL_NATS_URL=" + strings.Join(urls, ","), "SPIEGEL_COUCHDB_URL=" + cu}, nil
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
	if l.couch != nil {
		l.couch.close()
	}
}
