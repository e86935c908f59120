package chaos

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The plan derives from the config alone: a replay runs the same ops and faults.
func TestPlanIsDeterministic(t *testing.T) {
	t.Parallel()
	cfg := shortConfig("/repo")
	a, b := newPlan(cfg), newPlan(cfg)
	assert.Equal(t, a.Digest(), b.Digest())
	assert.Equal(t, a, b)
	cfg.Seed++
	assert.NotEqual(t, a.Digest(), newPlan(cfg).Digest(), "another seed, another plan")
}

// Every run has one fault of every required class (each kind of process killed), inside the
// window, and password rotations far enough apart; with the opt-in classes on, one of each of
// them too.
func TestPlanCoversEveryFaultClass(t *testing.T) {
	t.Parallel()
	for _, seed := range []uint64{1, 2, 3, 42, 20260611} {
		for _, optIn := range []bool{false, true} {
			cfg := shortConfig("/repo")
			cfg.Seed, cfg.Partitions, cfg.StoreLoss = seed, optIn, optIn
			p := newPlan(cfg)
			kinds := map[FaultKind]bool{}
			killed := map[string]bool{}
			leaderFaults := map[string]bool{} // "<kind> <consumer>"
			var rotations []time.Duration
			for _, f := range p.Faults {
				kinds[f.Kind] = true
				if f.Kind == FaultKillProc {
					killed[strings.SplitN(procNames[f.Target], "-", 2)[0]] = true
				}
				if f.Kind == FaultStopProc {
					assert.Greater(t, f.Down, cfg.AckWait, "a SIGSTOP outlasts AckWait")
					assert.GreaterOrEqual(t, f.Target, 2, "only consumers are stopped")
				}
				if f.Kind == FaultRotatePasswords {
					rotations = append(rotations, f.At)
				}
				if f.Kind == FaultStepdownConsumer || f.Kind == FaultNATSConsumerLdr {
					require.Less(t, f.Target, len(workConsumers))
					leaderFaults[f.Kind.String()+" "+workConsumers[f.Target]] = true
				}
				assert.True(t, f.At >= 3*time.Second && f.At < cfg.Duration, "fault at %s", f.At)
			}
			for _, req := range requiredFor(cfg) {
				assert.True(t, kinds[req.kind], "seed %d: no %s fault", seed, req.kind)
			}
			assert.Equal(t, optIn, kinds[FaultPartitionNATS] && kinds[FaultPartitionCouch] &&
				kinds[FaultNATSStoreLoss] && kinds[FaultNATSStoreLossAll], "seed %d, opt-in %t: %v", seed, optIn, kinds)
			for _, k := range []string{"producer", "replicator", "onchange"} {
				assert.True(t, killed[k], "seed %d: no %s killed", seed, k)
			}
			for _, k := range []string{"stepdown-work-consumer onchange", "stepdown-work-consumer replicator", "kill-nats-consumer-leader onchange"} {
				assert.True(t, leaderFaults[k], "seed %d: no %s", seed, k)
			}
			for i := 1; i < len(rotations); i++ {
				assert.GreaterOrEqual(t, rotations[i]-rotations[i-1], 2*(cfg.AckWait+4*time.Second))
			}
		}
	}
}

// The partition and storage-loss faults are opt-in (CHAOS_PARTITIONS, CHAOS_STORE_LOSS): a
// default short or long run plans none of them and its plan text has none of their fields
// (cut=, lag=), so that it reads and hashes as before these classes existed; turning them on
// changes the plan.
func TestPlanOptInFaultsOffByDefault(t *testing.T) {
	t.Parallel()
	long, err := longConfig("/repo")
	require.NoError(t, err)
	for _, cfg := range []Config{shortConfig("/repo"), long} {
		if cfg.Seed == 0 {
			cfg.Seed = 42
		}
		assert.False(t, cfg.Partitions || cfg.StoreLoss, "%s run: opt-in faults on by default", cfg.Name)
		plan := newPlan(cfg)
		for _, f := range plan.Faults {
			assert.Less(t, f.Kind, FaultPartitionNATS, "%s run: %s planned by default", cfg.Name, f.Kind)
		}
		var text strings.Builder
		plan.write(&text)
		assert.NotContains(t, text.String(), "cut=")
		assert.NotContains(t, text.String(), "lag=")
		on := cfg
		on.Partitions, on.StoreLoss = true, true
		assert.NotEqual(t, plan.Digest(), newPlan(on).Digest(), "%s run: the opt-in faults change the plan", cfg.Name)
	}
}

// The consumer leader faults are in the default fault set, not opt-in: a durable deployment
// meets them (a rolling upgrade moves leaders). The long run draws them beyond the required
// ones too, for both work consumers; a stepdown lasts no time, a leader's node is down as long
// as the other node kills.
func TestPlanConsumerLeaderFaults(t *testing.T) {
	t.Parallel()
	long, err := longConfig("/repo")
	require.NoError(t, err)
	long.Seed = 42
	seen := map[string]int{}
	for _, f := range newPlan(long).Faults {
		switch f.Kind {
		case FaultStepdownConsumer:
			assert.Zero(t, f.Down)
		case FaultNATSConsumerLdr:
			assert.GreaterOrEqual(t, f.Down, time.Second)
			assert.Less(t, f.Down, 6*time.Second)
		default:
			continue
		}
		seen[f.Kind.String()+" "+workConsumers[f.Target]]++
	}
	for _, k := range []string{"stepdown-work-consumer onchange", "stepdown-work-consumer replicator",
		"kill-nats-consumer-leader onchange", "kill-nats-consumer-leader replicator"} {
		assert.Positive(t, seen[k], "long run: no %s in %v", k, seen)
	}
	assert.Greater(t, seen["stepdown-work-consumer onchange"]+seen["stepdown-work-consumer replicator"], 2, "long run: only the required stepdowns")
	assert.NotContains(t, requiredFor(long), FaultPartitionNATS)
	for _, k := range []FaultKind{FaultStepdownConsumer, FaultNATSConsumerLdr} {
		assert.Positive(t, weightsFor(long)[k], "%s weighted out of a default plan", k)
		assert.Less(t, k, FaultPartitionNATS, "%s numbered among the opt-in classes", k)
	}
}

// The writer's plan keeps its model: no op on a deleted db, recreations only when asked,
// ids of a recreated db in its new incarnation.
func TestPlanOpsFollowDBLifecycle(t *testing.T) {
	t.Parallel()
	for _, recreate := range []bool{false, true} {
		cfg, err := longConfig("/repo")
		require.NoError(t, err)
		cfg.Seed, cfg.Duration, cfg.DBs, cfg.Recreate = 5, 3*time.Minute, 20, recreate
		ops := newPlan(cfg).Ops
		live := map[int]int{} // db → incarnation, while live
		created := 0
		for _, op := range ops {
			inc, ok := live[op.DB]
			switch op.Kind {
			case OpCreateDB:
				require.False(t, ok, "db %d created while live", op.DB)
				live[op.DB] = op.Inc
				created++
			case OpDeleteDB:
				require.True(t, ok)
				delete(live, op.DB)
			default:
				require.True(t, ok, "op %s on deleted db %d", op.Kind, op.DB)
				require.Equal(t, inc, op.Inc)
			}
		}
		if recreate {
			assert.Greater(t, created, cfg.DBs, "some dbs recreated")
		} else {
			assert.Equal(t, cfg.DBs, created)
		}
	}
}

// With CHAOS_PARTITIONS=1 and CHAOS_STORE_LOSS=1, long runs partition every kind of process from
// NATS and from CouchDB, both ways (freeze and cut), for durations around AckWait, and lose the
// store of one node and of every node (one of each is required in every run; the other
// combinations are drawn by weight, so they are checked over five seeds); the required NATS
// partition of an onchange consumer is a freeze longer than AckWait and the rule's timeout (the
// lease verdict's case).
func TestPlanPartitionsAndStoreLoss(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for _, seed := range []uint64{42, 43, 44, 45, 46} {
		cfg, err := longConfig("/repo")
		require.NoError(t, err)
		cfg.Seed, cfg.Partitions, cfg.StoreLoss = seed, true, true
		seenPlan(t, cfg, seen)
	}
	for _, k := range []FaultKind{FaultPartitionNATS, FaultPartitionCouch} {
		for _, proc := range []string{"producer", "replicator", "onchange"} {
			for _, cut := range []bool{false, true} {
				assert.True(t, seen[fmt.Sprintf("%s %s cut=%t", k, proc, cut)], "no %s of a %s with cut=%t", k, proc, cut)
			}
		}
	}
	assert.True(t, seen["nats-store-loss"] && seen["nats-store-loss-all"], "store losses: %v", seen)

	for _, seed := range []uint64{1, 2, 3, 20260611} {
		cfg := shortConfig("/repo")
		cfg.Seed, cfg.Partitions = seed, true
		found := false
		for _, f := range newPlan(cfg).Faults {
			if f.Kind == FaultPartitionNATS && strings.HasPrefix(procNames[f.Target], "onchange") && !f.Cut && f.Down > cfg.AckWait+hookTimeout {
				found = true
			}
		}
		assert.True(t, found, "seed %d: no freeze of an onchange consumer's NATS link longer than AckWait + the rule's timeout", seed)
	}
}

// seenPlan adds the partitions and storage losses of cfg's plan to seen ("<kind> <process kind>
// cut=<cut>", "<kind>"), checking their durations and lags.
func seenPlan(t *testing.T, cfg Config, seen map[string]bool) {
	t.Helper()
	for _, f := range newPlan(cfg).Faults {
		switch f.Kind {
		case FaultPartitionNATS, FaultPartitionCouch:
			kind := strings.SplitN(procNames[f.Target], "-", 2)[0]
			seen[fmt.Sprintf("%s %s cut=%t", f.Kind, kind, f.Cut)] = true
			assert.GreaterOrEqual(t, f.Down, cfg.AckWait/2)
			assert.Less(t, f.Down, 2*cfg.AckWait+hookTimeout+4*time.Second)
		case FaultNATSStoreLoss, FaultNATSStoreLossAll:
			seen[f.Kind.String()] = true
			assert.GreaterOrEqual(t, f.Lag, 2*time.Second)
		}
	}
}

// With CHAOS_COUCHDB_NODE_CMD and a cluster's nodes in CHAOS_COUCHDB_URL, the plan kills CouchDB
// nodes: node 1 (the processes use it first) among them, never the last node (the run's own
// requests use it), each down long enough for the processes to move to another node; the kills
// after the required one (node 1) pick either other node, which over the seeds both get. A node
// list without the command plans as one server does.
func TestPlanCouchNodeKill(t *testing.T) {
	t.Parallel()
	drawn := map[int]int{} // the targets of the kills after the first, over the seeds
	for _, seed := range []uint64{1, 2, 3, 42, 4242} {
		cfg, err := longConfig("/repo")
		require.NoError(t, err)
		cfg.Seed, cfg.CouchNodes = seed, 3
		base := newPlan(cfg)
		one := cfg
		one.CouchNodes = 0
		assert.Equal(t, newPlan(one).Digest(), base.Digest(), "seed %d: a node list alone changes the plan", seed)

		cfg.CouchNodeCmd = "cluster-ctl $CHAOS_NODE_ACTION $CHAOS_NODE"
		kills := 0
		targets := map[int]bool{}
		for _, f := range newPlan(cfg).Faults {
			if f.Kind != FaultCouchNode {
				continue
			}
			kills++
			targets[f.Target] = true
			if kills > 1 {
				drawn[f.Target]++
			}
			assert.Less(t, f.Target, cfg.CouchNodes-1, "seed %d: the last node is killed", seed)
			assert.GreaterOrEqual(t, f.Down, 5*time.Second)
			assert.Less(t, f.Down, 25*time.Second)
		}
		assert.Positive(t, kills, "seed %d: no node killed", seed)
		assert.True(t, targets[0], "seed %d: node 1, which the processes use first, never killed", seed)
	}
	assert.Len(t, drawn, 2, "the kills after the first: %v", drawn)
	for node, n := range drawn {
		assert.GreaterOrEqual(t, 4*n, drawn[0]+drawn[1], "node %d killed %d times of %v", node+1, n, drawn)
	}
}

// The onchange consumer's required leader changes (a stepdown and its node killed) are aimed at
// a block job, and every other drawn one; the replicator's never. Each aimed fault has a burst
// of new docs in a live block-rule db AckWait before it (not before 1s), long enough for the
// block rule to take two AckWaits over; the plan's text marks the aimed faults.
func TestPlanAimsOnchangeLeaderChanges(t *testing.T) {
	t.Parallel()
	long, err := longConfig("/repo")
	require.NoError(t, err)
	for _, base := range []Config{shortConfig("/repo"), long} {
		for _, seed := range []uint64{1, 2, 42, 20260611} {
			cfg := base
			cfg.Seed = seed
			p := newPlan(cfg)
			var text strings.Builder
			p.write(&text)
			var aimedAt []time.Duration
			required := map[FaultKind]bool{}
			drawn, drawnAimed := 0, 0
			for i, f := range p.Faults {
				onchangeLeader := f.Target == 0 && (f.Kind == FaultStepdownConsumer || f.Kind == FaultNATSConsumerLdr)
				if !onchangeLeader {
					assert.False(t, f.InBlockJob, "seed %d: %s target %d is not aimed", seed, f.Kind, f.Target)
					continue
				}
				if i < len(requiredFor(cfg)) && !required[f.Kind] {
					required[f.Kind] = true
					assert.True(t, f.InBlockJob, "seed %d: the required %s onchange is aimed", seed, f.Kind)
				} else {
					assert.Equal(t, drawn%2 == 0, f.InBlockJob, "seed %d: drawn %s onchange #%d", seed, f.Kind, drawn)
					drawn++
					if f.InBlockJob {
						drawnAimed++
					}
				}
				if f.InBlockJob {
					aimedAt = append(aimedAt, f.At)
				}
			}
			assert.True(t, required[FaultStepdownConsumer] && required[FaultNATSConsumerLdr], "seed %d", seed)
			assert.Equal(t, len(aimedAt), strings.Count(text.String(), " in-block-job\n"))
			if cfg.Name == "long" {
				assert.Positive(t, drawnAimed, "seed %d: the long run aims some drawn ones too", seed)
				assert.Less(t, drawnAimed, drawn, "seed %d: and leaves some at random moments", seed)
			}

			var bursts []Op
			for _, o := range p.Ops {
				if o.Kind == OpBulk && len(o.Docs) == int(2*cfg.AckWait/slowFor) {
					bursts = append(bursts, o)
				}
			}
			require.Len(t, bursts, len(aimedAt), "seed %d: one burst per aimed fault", seed)
			for i, b := range bursts {
				assert.Equal(t, max(aimedAt[i]-cfg.AckWait, time.Second), b.At, "seed %d", seed)
				assert.Less(t, b.DB, slowDBs, "seed %d: a block-rule db", seed)
				live := false // the db's incarnation is live at the burst's moment
				for _, o := range p.Ops {
					if o.At > b.At || o.DB != b.DB {
						continue
					}
					switch o.Kind {
					case OpCreateDB:
						live = o.Inc == b.Inc
					case OpDeleteDB:
						live = false
					}
				}
				assert.True(t, live, "seed %d: burst %d into a live db", seed, i)
			}
		}
	}
}

// A burst adds only new docs, to the block-rule db its index names (modulo their number) unless
// that one already had more bursts than another, and is the same for the same inputs.
func TestPlanBurstsGoToBlockDBs(t *testing.T) {
	t.Parallel()
	cfg := shortConfig("/repo")
	cfg.Duration, cfg.OpsPerS = 10*time.Second, 0.001 // no op of the writer's own: the dbs stay live
	s := time.Second
	bursts := []burst{{At: 2 * s, N: 1, Docs: 4}, {At: 3 * s, N: 5, Docs: 2}, {At: 4 * s, N: 1, Docs: 1}, {At: 5 * s, N: 0, Docs: 1}}
	ops := planOps(cfg, bursts)
	var got []Op
	for _, o := range ops {
		if o.Kind == OpBulk {
			got = append(got, o)
		}
	}
	require.Len(t, got, 4)
	assert.Equal(t, []int{1, 2, 0, 0}, []int{got[0].DB, got[1].DB, got[2].DB, got[3].DB},
		"N modulo the block-rule dbs; the third's db 1 and the next, db 2, had one already; then all have one")
	assert.Equal(t, []int{0, 1, 2, 3}, got[0].Docs)
	assert.Equal(t, []int{0, 1}, got[1].Docs)
	assert.Equal(t, []int{1}, got[3].Docs)
	assert.Equal(t, planOps(cfg, bursts), ops, "deterministic")
}
