package consumer

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// A producer's rule feed shows a new rule and stamps the jobs it enqueues for it with its rule
// set's seq; this consumer's own rule feed has not applied the rule yet (here: it is not
// following at all). The job is not run with the old rules: it waits, and fails as behind (to
// be retried) once the wait is over. When the consumer's feed applies the rule, the job runs,
// and the handler sees the rule. Before, the handler ran at once without the rule and the job
// was acked: the new rule skipped the db.
func TestJobWaitsForTheRulesItWasPublishedWith(t *testing.T) {
	cs := couchtest.Get(t)
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	require.NoError(t, natsjs.Ensure(t.Context(), js, natsjs.DefaultTopology("spiegel")))
	spiegelDB := couchtest.UniqueName(t, "ar") + "_spiegel"
	cs.CreateDB(t, spiegelDB)
	cfg := config.Consumer{
		CouchDB:     config.CouchDB{CouchDBURL: cs.URL, DBName: spiegelDB, CouchDBTimeout: 5 * time.Second},
		NATS:        config.NATS{NATSURL: ns.URL(), SubjectPrefix: "spiegel", StreamReplicas: 1, AckWait: 30 * time.Second},
		Concurrency: 1, ShutdownGrace: time.Second, RetryInitial: 100 * time.Millisecond, RetryMax: time.Second,
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	app, err := Open(ctx, &cfg, events.GroupOnChange, logrus.New())
	require.NoError(t, err)
	app.rulesWait = 300 * time.Millisecond

	// The producer's follower applies the new rule live.
	producerRules := rules.NewSet()
	pf := &rulefeed.Follower{Couch: app.Couch, DB: spiegelDB, Set: producerRules, Log: logrus.New()}
	from, err := pf.Load(ctx)
	require.NoError(t, err)
	go pf.Follow(ctx, from)
	cs.Put(t, spiegelDB, "hook", map[string]any{"type": "on_change", "url": "https://hooks.example.com/x"})
	require.Eventually(t, func() bool { _, ok := producerRules.Rule("hook"); return ok }, 10*time.Second, 20*time.Millisecond)
	job := &worker.Job{Group: events.GroupOnChange, DB: "userdb", Reason: events.ReasonRule, Rules: pf.AppliedSeq()}
	require.NotEmpty(t, job.Rules)

	var runs, withRule atomic.Int32
	h := app.awaitRules(func(context.Context, *worker.Job) error {
		runs.Add(1)
		if _, ok := app.Rules.Rule("hook"); ok {
			withRule.Add(1)
		}
		return nil
	})
	err = h(ctx, job)
	require.ErrorIs(t, err, rulefeed.ErrRulesBehind, "the consumer's rules lag: the job is retried later")
	assert.Zero(t, runs.Load(), "never run with the old rules")

	go app.follower.Follow(ctx, app.rulesSeq)
	app.rulesWait = 10 * time.Second
	require.NoError(t, h(ctx, job))
	assert.Equal(t, int32(1), runs.Load())
	assert.Equal(t, int32(1), withRule.Load(), "run with the rule")

	// A job of the same producer state again: covered, no wait.
	require.NoError(t, h(ctx, job))
	// A job that names no rule set (an earlier release's) runs at once.
	require.NoError(t, h(ctx, &worker.Job{Group: events.GroupOnChange, DB: "userdb"}))
	assert.Equal(t, int32(3), runs.Load())
}
