package chaos

import (
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"
)

// OpKind is what one writer operation does.
type OpKind int

// Writer operations. Doc ids carry the db's incarnation ("i<inc>_d<k>"), so that no doc of a
// recreated db shares an id (or a revision tree) with a doc of an earlier incarnation.
const (
	OpCreateDB OpKind = iota // (re)create the source db: incarnation Inc starts
	OpPut                    // create doc Doc, or update it, or bring it back if deleted
	OpDelete                 // delete doc Doc
	OpConflict               // add a sibling of Doc's winning revision (_bulk_docs new_edits:false)
	OpResolve                // delete one losing leaf of Doc, if it has any
	OpBulk                   // _bulk_docs: create or update Docs
	OpDeleteDB               // delete the source db and then its target db
)

var opNames = [...]string{"create_db", "put", "delete", "conflict", "resolve", "bulk", "delete_db"}

func (k OpKind) String() string { return opNames[k] }

// Op is one planned writer operation.
type Op struct {
	At   time.Duration // offset from the start of the writer
	DB   int           // source db index
	Inc  int           // the db's incarnation
	Kind OpKind
	Doc  int    // OpPut, OpDelete, OpConflict, OpResolve
	Docs []int  // OpBulk
	Salt uint64 // body content; the sibling's revision hash
}

// docID is the id of doc k in incarnation inc.
func docID(inc, k int) string { return fmt.Sprintf("i%d_d%04d", inc, k) }

// FaultKind is a class of fault.
type FaultKind int

// Fault classes.
const (
	FaultKillProc         FaultKind = iota // SIGKILL a product process, restart it after Down
	FaultStopProc                          // SIGSTOP a consumer for Down (longer than AckWait), then SIGCONT
	FaultNATSWorkLdr                       // SIGKILL the NATS node leading the work stream, restart after Down
	FaultNATSMetaLdr                       // SIGKILL the JetStream meta leader, restart after Down
	FaultNATSNode                          // SIGKILL NATS node Target, restart after Down
	FaultCouchRestart                      // stop CouchDB (SIGKILL or SIGTERM), start it after Down
	FaultSink500                           // the webhook sink answers 500 to every request for Down
	FaultSinkStall                         // the webhook sink answers after the rule's timeout for Down
	FaultRotatePasswords                   // new webhook password: passwords file rewritten, SIGHUP to consumers
	FaultStepdownConsumer                  // ask the leader of work consumer Target (workConsumers) to step down
	FaultNATSConsumerLdr                   // SIGKILL the NATS node leading work consumer Target (workConsumers), restart after Down
	FaultPartitionNATS                     // partition process Target from every NATS node for Down: freeze, or Cut
	FaultPartitionCouch                    // partition process Target from CouchDB for Down: freeze, or Cut
	FaultNATSStoreLoss                     // NATS node Target restarted from a copy of its store taken Lag before its SIGKILL
	FaultNATSStoreLossAll                  // every NATS node SIGKILLed at once and restarted from copies of their stores taken Lag before
	FaultCouchNode                         // kill CouchDB cluster node Target (never the last of the list), start it after Down
	numFaultKinds
)

var faultNames = [...]string{"kill", "stop", "kill-nats-work-leader", "kill-nats-meta-leader", "kill-nats-node",
	"restart-couchdb", "sink-500", "sink-stall", "rotate-passwords", "stepdown-work-consumer", "kill-nats-consumer-leader", "partition-nats", "partition-couchdb",
	"nats-store-loss", "nats-store-loss-all", "kill-couchdb-node"}

func (k FaultKind) String() string { return faultNames[k] }

// Fault is one planned fault.
type Fault struct {
	At     time.Duration
	Kind   FaultKind
	Target int           // product process index (procNames), NATS node index, or work consumer index (workConsumers)
	Down   time.Duration // how long the fault lasts
	Term   bool          // FaultCouchRestart: SIGTERM instead of SIGKILL
	Cut    bool          // FaultPartitionNATS, FaultPartitionCouch: connections reset instead of frozen
	Lag    time.Duration // FaultNATSStoreLoss(All): the store copy is this old when the node is killed
	// InBlockJob (FaultStepdownConsumer, FaultNATSConsumerLdr of the onchange consumer): from At
	// the fault waits, at most aimWithin, for a block job of at least AckWait in progress, and
	// strikes while its call is open (blockjob.go).
	InBlockJob bool
}

// procNames are the product processes, by index.
var procNames = []string{"producer-1", "producer-2", "replicator-native", "replicator-couchdb", "onchange-1", "onchange-2"}

// workConsumers are the durable consumers of the work stream, by index: the consumer-leader
// faults' targets.
var workConsumers = []string{"onchange", "replicator"}

// Plan is everything a run does on purpose, derived from the Config alone.
type Plan struct {
	Ops    []Op
	Faults []Fault
}

// newPlan derives the plan of cfg. Writer ops and faults come from separate random streams of
// the seed. Contract: the same Config always gives the same Plan (see Digest).
func newPlan(cfg Config) Plan {
	faults := planFaults(cfg)
	return Plan{Ops: planOps(cfg, blockBursts(cfg, faults)), Faults: faults}
}

// burst is a writer burst planned for an aimed fault (Fault.InBlockJob): at At, a _bulk_docs of
// Docs new docs into a live block-rule db: of those with the fewest bursts so far (so that no
// db's backlog grows by more than one burst at a time), the first from the Nth (the aimed
// fault's index among the aimed ones, modulo slowDBs) on.
type burst struct {
	At   time.Duration
	N    int
	Docs int
}

// blockBursts plans a burst for each aimed fault: AckWait before the fault's moment (not before
// the dbs exist, 1s), as many new docs as the block rule takes two AckWaits to call the webhook
// for (slowFor each), so that a job of at least AckWait is under way when the fault looks for
// one. They draw nothing: the faults are as planned, and the writer's random draws are the same
// ones (what they pick in a burst's db may differ after it, its docs being more).
func blockBursts(cfg Config, faults []Fault) []burst {
	var out []burst
	for _, f := range faults {
		if !f.InBlockJob {
			continue
		}
		out = append(out, burst{At: max(f.At-cfg.AckWait, time.Second), N: len(out), Docs: int(2 * cfg.AckWait / slowFor)})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At < out[j].At })
	return out
}

// dbModel is the writer's model of one source db while the plan is generated.
type dbModel struct {
	live     bool
	inc      int
	next     int   // next new doc index
	docs     []int // live doc indexes
	deleted  []int // deleted doc indexes
	conflict map[int]bool
}

func (m *dbModel) take(list *[]int, r *rand.Rand) int {
	i := r.IntN(len(*list))
	k := (*list)[i]
	(*list)[i] = (*list)[len(*list)-1]
	*list = (*list)[:len(*list)-1]
	return k
}

// planOps plans the writer: every db is created at the start, then operations arrive at
// OpsPerS on uniformly chosen live dbs. With cfg.Recreate a deleted db is recreated (next
// incarnation) after a delay, QuickRecreatePct% of the time shorter than a poll round; it stays
// deleted if that falls after the end (and always without cfg.Recreate). The bursts (sorted by
// At) are bulk ops of new docs into a live block-rule db (see burst), at their moments; one whose
// block-rule dbs are all deleted then is left out.
func planOps(cfg Config, bursts []burst) []Op {
	r := rand.New(rand.NewPCG(cfg.Seed, 0x7772697465))
	dbs := make([]*dbModel, cfg.DBs)
	var ops []Op
	for i := range dbs {
		dbs[i] = &dbModel{live: true, conflict: map[int]bool{}}
		ops = append(ops, Op{At: time.Duration(i) * time.Second / time.Duration(cfg.DBs), DB: i, Kind: OpCreateDB})
	}
	type due struct {
		at time.Duration
		db int
	}
	var recreate []due
	slow := min(slowDBs, cfg.DBs)
	burstsIn := make([]int, slow) // bursts so far per block-rule db
	doBurst := func(b burst) {
		i := -1
		for j := range slow {
			if k := (b.N + j) % slow; dbs[k].live && (i < 0 || burstsIn[k] < burstsIn[i]) {
				i = k
			}
		}
		if i >= 0 {
			burstsIn[i]++
			m := dbs[i]
			op := Op{At: b.At, DB: i, Inc: m.inc, Kind: OpBulk, Salt: cfg.Seed ^ uint64(b.At)}
			for range b.Docs {
				op.Docs = append(op.Docs, m.next)
				m.docs = append(m.docs, m.next)
				m.next++
			}
			ops = append(ops, op)
		}
	}
	t := time.Second
	for {
		t += time.Duration(r.ExpFloat64() / cfg.OpsPerS * float64(time.Second))
		sort.Slice(recreate, func(i, j int) bool { return recreate[i].at < recreate[j].at })
		// Recreations and bursts due by t, in the order of their moments.
		for {
			rec := len(recreate) > 0 && recreate[0].at <= t && recreate[0].at < cfg.Duration
			bur := len(bursts) > 0 && bursts[0].At <= t && bursts[0].At < cfg.Duration
			if bur && (!rec || bursts[0].At < recreate[0].at) {
				doBurst(bursts[0])
				bursts = bursts[1:]
				continue
			}
			if !rec {
				break
			}
			d := recreate[0]
			recreate = recreate[1:]
			m := dbs[d.db]
			*m = dbModel{live: true, inc: m.inc + 1, conflict: map[int]bool{}}
			ops = append(ops, Op{At: d.at, DB: d.db, Inc: m.inc, Kind: OpCreateDB})
		}
		if t >= cfg.Duration {
			break
		}
		var live []int
		for i, m := range dbs {
			if m.live {
				live = append(live, i)
			}
		}
		if len(live) == 0 {
			continue
		}
		i := live[r.IntN(len(live))]
		m := dbs[i]
		op := Op{At: t, DB: i, Inc: m.inc, Salt: r.Uint64()}
		w := r.IntN(1000)
		switch {
		case w < 12 && t < cfg.Duration*9/10:
			op.Kind = OpDeleteDB
			m.live = false
			delay := time.Duration(1000+r.IntN(19000)) * time.Millisecond
			if r.IntN(100) < cfg.QuickRecreatePct {
				delay = time.Duration(100+r.IntN(900)) * time.Millisecond
			}
			if cfg.Recreate {
				recreate = append(recreate, due{t + delay, i})
			}
		case w < 100 && len(m.docs) > 0:
			op.Kind, op.Doc = OpDelete, m.take(&m.docs, r)
			m.deleted = append(m.deleted, op.Doc)
			delete(m.conflict, op.Doc)
		case w < 140 && len(m.deleted) > 0:
			op.Kind, op.Doc = OpPut, m.take(&m.deleted, r)
			m.docs = append(m.docs, op.Doc)
		case w < 220 && len(m.docs) > 0:
			op.Kind, op.Doc = OpConflict, m.docs[r.IntN(len(m.docs))]
			m.conflict[op.Doc] = true
		case w < 260 && len(m.conflict) > 0:
			op.Kind = OpResolve
			keys := make([]int, 0, len(m.conflict))
			for k := range m.conflict {
				keys = append(keys, k)
			}
			sort.Ints(keys)
			op.Doc = keys[r.IntN(len(keys))]
			delete(m.conflict, op.Doc)
		case w < 360:
			op.Kind = OpBulk
			for range 3 + r.IntN(12) {
				if len(m.docs) > 0 && r.IntN(2) == 0 {
					op.Docs = append(op.Docs, m.docs[r.IntN(len(m.docs))])
				} else {
					op.Docs = append(op.Docs, m.next)
					m.docs = append(m.docs, m.next)
					m.next++
				}
			}
			op.Docs = dedupe(op.Docs)
		case w < 660 && len(m.docs) > 0:
			op.Kind, op.Doc = OpPut, m.docs[r.IntN(len(m.docs))]
		default:
			op.Kind, op.Doc = OpPut, m.next
			m.docs = append(m.docs, m.next)
			m.next++
		}
		ops = append(ops, op)
	}
	sort.SliceStable(ops, func(i, j int) bool { return ops[i].At < ops[j].At })
	return ops
}

func dedupe(xs []int) []int {
	seen := map[int]bool{}
	out := xs[:0]
	for _, x := range xs {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

// requiredFaults is one of every class, with the kinds of process each kill must cover: the
// first faults of every run are these, in an order the seed shuffles. The opt-in classes
// (partitionFaults, storeLossFaults) are added by requiredFor when the config turns them on.
var requiredFaults = []requiredFault{
	{FaultKillProc, []int{0, 1}}, {FaultKillProc, []int{2}}, {FaultKillProc, []int{3}}, {FaultKillProc, []int{4, 5}},
	{FaultStopProc, []int{4, 5}}, {FaultNATSWorkLdr, nil}, {FaultNATSMetaLdr, nil}, {FaultCouchRestart, nil},
	{FaultSink500, nil}, {FaultSinkStall, nil}, {FaultRotatePasswords, nil},
	// Consumer leader changes, as a rolling upgrade makes them: a stepdown of each work
	// consumer's leader, and the node leading the onchange consumer killed. The onchange ones
	// are aimed (aimed): they strike inside a long block job, the overlap verdict's case.
	{FaultStepdownConsumer, []int{0}}, {FaultStepdownConsumer, []int{1}}, {FaultNATSConsumerLdr, []int{0}},
}

// aimed reports whether a fault of kind on target is aimed at a block job (Fault.InBlockJob):
// the required leader changes of the onchange consumer always are; of the ones drawn later,
// every other one (the first, third, …: drawn is how many came before it), so that leader
// changes at random moments stay in the long run's plan too. It draws nothing: the plan's
// other faults and moments are what they were before faults were aimed.
func aimed(kind FaultKind, target int, required bool, drawn int) bool {
	if target != 0 || kind != FaultStepdownConsumer && kind != FaultNATSConsumerLdr {
		return false
	}
	return required || drawn%2 == 0
}

type requiredFault struct {
	kind    FaultKind
	targets []int
}

// partitionFaults are required with Config.Partitions. An onchange consumer frozen off NATS for
// longer than AckWait: the lease verdict's case.
var partitionFaults = []requiredFault{{FaultPartitionNATS, []int{4, 5}}, {FaultPartitionCouch, []int{0, 1, 2, 3, 4, 5}}}

// storeLossFaults are required with Config.StoreLoss.
var storeLossFaults = []requiredFault{{FaultNATSStoreLoss, nil}, {FaultNATSStoreLossAll, nil}}

// nodeKill reports whether cfg kills CouchDB cluster nodes: a node command and a list of nodes.
func (c Config) nodeKill() bool { return c.CouchNodeCmd != "" && c.CouchNodes >= 2 }

// requiredFor is the required faults of cfg: requiredFaults, then the opt-in classes it turns on.
func requiredFor(cfg Config) []requiredFault {
	req := slices.Clone(requiredFaults)
	if cfg.nodeKill() {
		req = append(req, requiredFault{FaultCouchNode, nil})
	}
	if cfg.Partitions {
		req = append(req, partitionFaults...)
	}
	if cfg.StoreLoss {
		req = append(req, storeLossFaults...)
	}
	return req
}

// faultWeights are the odds of each class after the required ones; an opt-in class the config
// does not turn on has none (weightsFor), so that a plan without them draws exactly as before
// they existed.
var faultWeights = [numFaultKinds]int{30, 10, 8, 6, 6, 6, 8, 6, 6, 6, 5, 10, 8, 3, 2, 6}

// weightsFor is faultWeights with the opt-in classes cfg does not turn on left out.
func weightsFor(cfg Config) [numFaultKinds]int {
	w := faultWeights
	if !cfg.Partitions {
		w[FaultPartitionNATS], w[FaultPartitionCouch] = 0, 0
	}
	if !cfg.StoreLoss {
		w[FaultNATSStoreLoss], w[FaultNATSStoreLossAll] = 0, 0
	}
	if !cfg.nodeKill() {
		w[FaultCouchNode] = 0
	}
	return w
}

// planFaults plans the faults: max(#required, window/FaultEvery) of them at uniformly random
// moments between a warm-up of 3s and 2s before the end; the required ones first (shuffled),
// the rest by weightsFor(cfg). Password rotations are kept at least rotationGap apart, so that a
// stopped consumer never misses two (the sink accepts the current and the previous password).
func planFaults(cfg Config) []Fault {
	r := rand.New(rand.NewPCG(cfg.Seed, 0x6661756c74))
	from, to := 3*time.Second, cfg.Duration-2*time.Second
	required, weights := requiredFor(cfg), weightsFor(cfg)
	n := max(len(required), int((to-from)/cfg.FaultEvery))
	times := make([]time.Duration, n)
	for i := range times {
		times[i] = from + time.Duration(r.Int64N(int64(to-from)))
	}
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	kinds := r.Perm(len(required))
	rotationGap := 2 * (cfg.AckWait + 4*time.Second)
	lastRotation := -rotationGap
	drawnLeader := 0 // onchange consumer leader changes drawn so far, after the required ones
	var out []Fault
	for i, at := range times {
		var f Fault
		isRequired := i < len(kinds)
		if isRequired {
			req := required[kinds[i]]
			f = Fault{Kind: req.kind}
			if len(req.targets) > 0 {
				f.Target = req.targets[r.IntN(len(req.targets))]
			}
		} else {
			f = Fault{Kind: weighted(r, weights), Target: r.IntN(len(procNames))}
			if f.Kind == FaultStopProc {
				f.Target = 2 + r.IntN(4) // consumers only
			}
			if f.Kind == FaultNATSNode || f.Kind == FaultNATSStoreLoss {
				f.Target = r.IntN(3)
			}
			if f.Kind == FaultStepdownConsumer || f.Kind == FaultNATSConsumerLdr {
				f.Target = r.IntN(len(workConsumers))
			}
		}
		f.At = at
		if f.InBlockJob = aimed(f.Kind, f.Target, isRequired, drawnLeader); !isRequired && f.Target == 0 &&
			(f.Kind == FaultStepdownConsumer || f.Kind == FaultNATSConsumerLdr) {
			drawnLeader++
		}
		switch f.Kind {
		case FaultKillProc:
			f.Down = time.Duration(r.IntN(4000)) * time.Millisecond
		case FaultStopProc:
			f.Down = cfg.AckWait + time.Duration(1000+r.IntN(3000))*time.Millisecond
		case FaultNATSWorkLdr, FaultNATSMetaLdr, FaultNATSNode, FaultNATSConsumerLdr:
			f.Down = time.Duration(1000+r.IntN(5000)) * time.Millisecond
		case FaultCouchRestart:
			f.Down, f.Term = time.Duration(500+r.IntN(2500))*time.Millisecond, r.IntN(2) == 0
		case FaultSink500:
			f.Down = time.Duration(2000+r.IntN(6000)) * time.Millisecond
		case FaultSinkStall:
			f.Down = time.Duration(2000+r.IntN(5000)) * time.Millisecond
		case FaultPartitionNATS, FaultPartitionCouch:
			// Around AckWait: from half of it to twice it.
			f.Down = cfg.AckWait/2 + time.Duration(r.Int64N(int64(3*cfg.AckWait/2)))
			f.Cut = r.IntN(2) == 0
			if isRequired && f.Kind == FaultPartitionNATS {
				// The lease verdict's case: a freeze that outlasts AckWait and the rule's
				// timeout, during which the frozen instance must stop calling the webhook.
				f.Cut, f.Down = false, cfg.AckWait+hookTimeout+time.Duration(1000+r.IntN(3000))*time.Millisecond
			}
		case FaultNATSStoreLoss, FaultNATSStoreLossAll:
			if isRequired && f.Kind == FaultNATSStoreLoss {
				f.Target = r.IntN(3)
			}
			f.Lag = time.Duration(2000+r.IntN(6000)) * time.Millisecond
			f.Down = time.Duration(500+r.IntN(2000)) * time.Millisecond
		case FaultCouchNode:
			// Any node but the last, which the run's own requests use; the required one kills
			// the first, which the processes use until it fails. Down long enough for the
			// processes to move to another node and work there.
			f.Target = r.IntN(cfg.CouchNodes - 1)
			if isRequired {
				f.Target = 0
			}
			f.Down = time.Duration(5000+r.IntN(20000)) * time.Millisecond
		case FaultRotatePasswords:
			if at-lastRotation < rotationGap {
				continue
			}
			lastRotation = at
		}
		out = append(out, f)
	}
	return out
}

func weighted(r *rand.Rand, weights [numFaultKinds]int) FaultKind {
	total := 0
	for _, w := range weights {
		total += w
	}
	x := r.IntN(total)
	for k, w := range weights {
		if x < w {
			return FaultKind(k)
		}
		x -= w
	}
	return FaultKillProc
}

// write writes the plan as text, one line per op and fault: what Digest hashes.
func (p Plan) write(w io.Writer) {
	for _, f := range p.Faults {
		// cut and lag only where they apply: a plan without the opt-in classes reads (and
		// hashes) as before they existed.
		extra := ""
		switch f.Kind {
		case FaultPartitionNATS, FaultPartitionCouch:
			extra = fmt.Sprintf(" cut=%t", f.Cut)
		case FaultNATSStoreLoss, FaultNATSStoreLossAll:
			extra = fmt.Sprintf(" lag=%s", f.Lag)
		}
		if f.InBlockJob {
			extra += " in-block-job"
		}
		fmt.Fprintf(w, "fault %9.3fs %-22s target=%d down=%s term=%t%s\n", f.At.Seconds(), f.Kind, f.Target, f.Down, f.Term, extra)
	}
	for _, o := range p.Ops {
		fmt.Fprintf(w, "op %9.3fs db=%03d inc=%d %-9s doc=%d docs=%v salt=%016x\n", o.At.Seconds(), o.DB, o.Inc, o.Kind, o.Doc, o.Docs, o.Salt)
	}
}

// Digest is the sha256 of the plan's text: equal digests mean the same operations and faults.
func (p Plan) Digest() string {
	h := sha256.New()
	p.write(h)
	return fmt.Sprintf("%x", h.Sum(nil))[:16]
}

// Summary counts the plan's ops and faults by kind.
func (p Plan) Summary() string {
	ops := map[string]int{}
	for _, o := range p.Ops {
		ops[o.Kind.String()]++
	}
	faults := map[string]int{}
	for _, f := range p.Faults {
		name := f.Kind.String()
		switch f.Kind {
		case FaultKillProc, FaultStopProc:
			name += " " + procNames[f.Target]
		case FaultPartitionNATS, FaultPartitionCouch:
			name += " " + procNames[f.Target] + map[bool]string{false: " freeze", true: " cut"}[f.Cut]
		case FaultCouchNode:
			name += fmt.Sprintf(" %d", f.Target+1)
		case FaultStepdownConsumer, FaultNATSConsumerLdr:
			name += " " + workConsumers[f.Target]
			if f.InBlockJob {
				name += " in a block job"
			}
		}
		faults[name]++
	}
	return fmt.Sprintf("%d writer ops %s; %d faults %s", len(p.Ops), counts(ops), len(p.Faults), counts(faults))
}

// counts formats a count map in key order.
func counts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return "{" + strings.Join(parts, ", ") + "}"
}
