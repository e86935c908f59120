package consumer_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// Each consumer's NATS micro service (what `nats micro ls` lists) carries the build's version,
// config.Version, as the producer's does: in $SRV.PING and $SRV.INFO, and in its status answer.
// Not parallel: it sets config.Version, which every app reads.
func TestServiceReportsVersion(t *testing.T) {
	was := config.Version
	t.Cleanup(func() { config.Version = was })
	config.Version = "v9.8.7-test"

	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	nc, js := ns.Connect(t)
	require.NoError(t, natsjs.Ensure(t.Context(), js, natsjs.DefaultTopology("spiegel")))
	spiegelDB := couchtest.UniqueName(t, "cv") + "_spiegel"
	cs.CreateDB(t, spiegelDB)
	cfg := config.Consumer{
		CouchDB:     config.CouchDB{CouchDBURL: cs.URL, DBName: spiegelDB, CouchDBTimeout: 5 * time.Second},
		NATS:        config.NATS{NATSURL: ns.URL(), SubjectPrefix: "spiegel", StreamReplicas: 1, AckWait: 30 * time.Second},
		Concurrency: 1, ShutdownGrace: time.Second, RetryInitial: 100 * time.Millisecond, RetryMax: time.Second,
	}
	for _, g := range []events.Group{events.GroupReplicate, events.GroupOnChange} {
		runApp(t, &cfg, g, "", logrus.New())
	}

	want := map[string]bool{"spiegel-replicator": true, "spiegel-onchange": true}
	var pings []micro.Ping
	require.Eventually(t, func() bool {
		pings = nil
		for _, data := range natstest.Answers(t, nc, "$SRV.PING", len(want), 2*time.Second) {
			var p micro.Ping
			if json.Unmarshal(data, &p) == nil && want[p.Name] {
				pings = append(pings, p)
			}
		}
		return len(pings) == len(want)
	}, 30*time.Second, 100*time.Millisecond, "both consumers answer $SRV.PING")
	for _, p := range pings {
		assert.Equal(t, "9.8.7-test", p.Version, p.Name)
		assert.Equal(t, status.SemVer(config.Version), p.Version, p.Name)
		assert.Equal(t, "v9.8.7-test", p.Metadata["version"], p.Name)
	}
	for _, subject := range []string{"spiegel.svc.replicator.status", "spiegel.svc.onchange.status"} {
		answers := natstest.Answers(t, nc, subject, 1, 5*time.Second)
		require.Len(t, answers, 1, subject)
		var rep status.Report
		require.NoError(t, json.Unmarshal(answers[0], &rep))
		assert.Equal(t, "v9.8.7-test", rep.Version, subject)
	}
}
