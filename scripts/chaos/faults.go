package chaos

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"
)

// faultRecord is what one fault did, as it happened.
type faultRecord struct {
	Fault
	// Offsets on the run's clock: the planned moment, when the fault took effect (after waiting
	// for the previous fault on its resource), and when it was over.
	Started, Began, Ended time.Duration
	What                  string // e.g. "SIGKILL nats-n2 (leader of SPIEGEL_WORK)"
	Skipped               string // why it did not run
	Err                   error
	Aim                   *aimRecord // an aimed fault (InBlockJob): the block job it struck in, the leader before and after
}

// faults runs the plan's faults, each at its planned moment in its own goroutine. Faults on
// one resource are serialized (a fault waits for the previous one on the same resource to
// end, so it may run later than planned; its record says when it was over): one NATS node down
// at a time (the streams keep a quorum of two), one CouchDB restart or node kill, one sink
// period, one fault per process.
type faults struct {
	r     *run
	start time.Time

	natsMu, couchMu, sinkMu, rotateMu sync.Mutex

	mu      sync.Mutex
	records []faultRecord
}

// run executes every fault and returns when all have ended (processes back and ready).
func (f *faults) run(ctx context.Context, plan []Fault) {
	var wg sync.WaitGroup
	for _, ft := range plan {
		if sleepCtx(ctx, time.Until(f.start.Add(ft.At))) != nil {
			break
		}
		wg.Go(func() {
			rec := faultRecord{Fault: ft, Started: f.r.since()}
			if ft.InBlockJob {
				rec.Aim = &aimRecord{}
			}
			var pr *probe
			rec.What, rec.Skipped, rec.Err = f.execute(ctx, ft, func() {
				rec.Began = f.r.since()
				pr = f.r.probes.begin(ctx, ft.Kind)
			}, rec.Aim)
			rec.Ended = f.r.since()
			f.r.probes.ended(pr, rec.Ended)
			f.mu.Lock()
			f.records = append(f.records, rec)
			f.mu.Unlock()
			switch {
			case rec.Skipped != "":
				f.r.logf("fault %s skipped: %s", ft.Kind, rec.Skipped)
			case rec.Err != nil:
				f.r.logf("fault %s (%s) FAILED: %v", ft.Kind, rec.What, rec.Err)
			default:
				f.r.logf("fault %-22s %s, %s → +%s", ft.Kind, rec.What, ft.Down.Round(time.Millisecond), rec.Ended)
			}
		})
	}
	wg.Wait()
}

// execute runs one fault and returns once it is over; mark is called when it takes effect. An
// aimed fault (InBlockJob) fills aim.
func (f *faults) execute(ctx context.Context, ft Fault, mark func(), aim *aimRecord) (what, skipped string, err error) {
	r := f.r
	if r.cfg.SkipFaults[ft.Kind.String()] {
		return "", "CHAOS_SKIP_FAULTS", nil
	}
	if ft.InBlockJob && aim != nil {
		return f.aimedLeaderChange(ctx, ft, mark, aim)
	}
	switch ft.Kind {
	case FaultKillProc:
		p := r.procs[ft.Target]
		p.Lock()
		defer p.Unlock()
		mark()
		if err := p.restart(ctx, syscall.SIGKILL, ft.Down); err != nil {
			return "SIGKILL " + p.name, "", err
		}
		return "SIGKILL " + p.name, "", f.ready(ctx, p)
	case FaultStopProc:
		p := r.procs[ft.Target]
		p.Lock()
		defer p.Unlock()
		mark()
		if err := p.signal(syscall.SIGSTOP); err != nil {
			return "SIGSTOP " + p.name, "", err
		}
		werr := sleepCtx(ctx, ft.Down)
		if err := p.signal(syscall.SIGCONT); err != nil {
			return "SIGSTOP " + p.name, "", err
		}
		return "SIGSTOP/SIGCONT " + p.name, "", werr
	case FaultNATSWorkLdr, FaultNATSMetaLdr, FaultNATSNode, FaultNATSConsumerLdr:
		f.natsMu.Lock()
		defer f.natsMu.Unlock()
		n, what, err := f.natsTarget(ctx, ft)
		if err != nil {
			return what, "", err
		}
		mark()
		return what, "", r.nats.killAndRestart(ctx, n, ft.Down)
	case FaultStepdownConsumer:
		f.natsMu.Lock()
		defer f.natsMu.Unlock()
		return r.nats.stepDownConsumer(ctx, r.subjects.WorkStream(), workConsumers[ft.Target%len(workConsumers)], mark)
	case FaultCouchRestart:
		f.couchMu.Lock()
		defer f.couchMu.Unlock()
		mark()
		return r.couch.restartWhat(ft.Term), "", r.couch.restart(ctx, ft.Term, ft.Down)
	case FaultCouchNode:
		f.couchMu.Lock()
		defer f.couchMu.Unlock()
		i := ft.Target % (len(r.couch.nodes) - 1)
		what := fmt.Sprintf("CouchDB node %d of %d killed (CHAOS_COUCHDB_NODE_CMD), started again after its down time", i+1, len(r.couch.nodes))
		return what, "", r.couch.killNode(ctx, i, ft.Down, mark)
	case FaultSink500, FaultSinkStall:
		f.sinkMu.Lock()
		defer f.sinkMu.Unlock()
		mark()
		mode, what := sinkFail, "sink answers 500"
		if ft.Kind == FaultSinkStall {
			mode, what = sinkStall, "sink stalls past the rule's timeout"
		}
		r.sink.setMode(mode)
		err := sleepCtx(ctx, ft.Down)
		r.sink.setMode(sinkNormal)
		return what, "", err
	case FaultPartitionNATS, FaultPartitionCouch:
		p := r.procs[ft.Target]
		p.Lock()
		defer p.Unlock()
		ps, with := p.links.nats, "NATS"
		if ft.Kind == FaultPartitionCouch {
			ps, with = p.links.couch, "CouchDB"
		}
		what := fmt.Sprintf("%s frozen off %s (no byte moves, connections stay open)", p.name, with)
		if ft.Cut {
			what = fmt.Sprintf("%s cut off %s (connections reset, new ones reset)", p.name, with)
		}
		return what, "", partition(ctx, ps, ft.Cut, ft.Down, mark)
	case FaultNATSStoreLoss, FaultNATSStoreLossAll:
		f.natsMu.Lock()
		defer f.natsMu.Unlock()
		nodes := r.nats.nodes
		what := fmt.Sprintf("every NATS node SIGKILLed and restarted from copies of its store %s old", ft.Lag.Round(time.Millisecond))
		if ft.Kind == FaultNATSStoreLoss {
			n := r.nats.nodes[ft.Target%len(r.nats.nodes)]
			nodes = []*natsNode{n}
			what = fmt.Sprintf("nats-%s SIGKILLed and restarted from a copy of its store %s old", n.name, ft.Lag.Round(time.Millisecond))
		}
		return what, "", r.nats.storeLoss(ctx, nodes, ft.Lag, ft.Down, mark)
	case FaultRotatePasswords:
		f.rotateMu.Lock()
		defer f.rotateMu.Unlock()
		mark()
		if err := r.sink.rotate(); err != nil {
			return "rotate", "", err
		}
		// A process being killed or restarted reads the new file when it starts; a SIGHUP that
		// reached it before it handles the signal would end it, so each waits for its own fault.
		var sent []string
		for _, p := range r.consumers() {
			p.Lock()
			if p.running() {
				if err := p.signal(syscall.SIGHUP); err == nil {
					sent = append(sent, p.name)
				}
			}
			p.Unlock()
		}
		return fmt.Sprintf("password generation %d, SIGHUP to %v", r.sink.generation(), sent), "", nil
	}
	return "", "", fmt.Errorf("unknown fault kind %d", ft.Kind)
}

// aimedLeaderChange runs an aimed fault (Fault.InBlockJob, blockjob.go): it waits for a block
// job of at least AckWait in progress (aimAt; the NATS faults' lock is taken only once one is),
// then asks the consumer's leader to step down or SIGKILLs the node leading it, at once, and
// fills a with the job, how long it had run when the fault took effect, and the leader before
// and after. Without such a job within aimWithin it strikes anyway, and a says why. It learns
// the leader first and then looks at the sink again (strike), so that the call it saw is still
// open when the fault takes effect.
func (f *faults) aimedLeaderChange(ctx context.Context, ft Fault, mark func(), a *aimRecord) (what, skipped string, err error) {
	r := f.r
	stream, consumer := r.subjects.WorkStream(), workConsumers[ft.Target%len(workConsumers)]
	find := func() (blockJob, bool, bool) {
		return openBlockJob(r.sink.slowCalls(), r.started, time.Now(), r.cfg.AckWait, r.cfg.AckWait)
	}
	job, missed, err := aimAt(ctx, aimWithin, aimStep, find, f.natsMu.Lock, f.natsMu.Unlock, r.cfg.AckWait)
	if err != nil {
		return fmt.Sprintf("%s of consumer %s, aimed at a block job", ft.Kind, consumer), "", err
	}
	defer f.natsMu.Unlock()
	a.Job, a.Missed = job, missed
	// strike is called once the leader is known, right before the stepdown or the SIGKILL:
	// learning the leader can take seconds on a busy cluster, so it looks again (the NATS lock
	// held) for a job of at least AckWait with a call open, at most 2 AckWaits, and strikes at
	// once; without one it strikes in the job it found.
	strike := func() {
		if missed == "" {
			if j, again, err := aimAt(ctx, 2*r.cfg.AckWait, aimStep, find, func() {}, func() {}, r.cfg.AckWait); err == nil && again == "" {
				a.Job = j
			}
		}
		mark()
		if missed == "" {
			a.Age = r.since() - a.Job.Start
		}
	}
	if ft.Kind == FaultStepdownConsumer {
		a.Before, a.After, err = r.nats.stepDown(ctx, stream, consumer, strike)
		return fmt.Sprintf("leader of consumer %s of %s asked to step down, %s", consumer, stream, a), "", err
	}
	what = fmt.Sprintf("SIGKILL the leader of consumer %s of %s", consumer, stream)
	if err := waitUntil(ctx, 20*time.Second, 100*time.Millisecond, "a leader to kill", func() bool {
		var lerr error
		a.Before, lerr = r.nats.consumerLeader(ctx, stream, consumer)
		return lerr == nil
	}); err != nil {
		return what, "", err
	}
	n, err := r.nats.node(a.Before)
	if err != nil {
		return what, "", err
	}
	err = r.nats.killAndRestartWatching(ctx, n, ft.Down, strike, func(down time.Duration) {
		dctx, cancel := context.WithTimeout(ctx, down)
		defer cancel()
		a.After = r.nats.newConsumerLeader(dctx, stream, consumer, a.Before, down)
	})
	if a.After == "" && err == nil {
		// No election finished while the node was down: whoever leads once it is back.
		a.After = r.nats.newConsumerLeader(ctx, stream, consumer, "", 20*time.Second)
	}
	return fmt.Sprintf("SIGKILL nats-%s (leader of consumer %s of %s), %s", n.name, consumer, stream, a), "", err
}

// ready waits until a restarted product process is ready again. CouchDB or NATS may be down
// meanwhile (another fault), so the wait is long; not being ready is recorded, not fatal.
func (f *faults) ready(ctx context.Context, p *proc) error {
	return p.waitReady(ctx, 90*time.Second)
}

// natsTarget picks the node a NATS fault kills: the leader of the work stream, of a work
// consumer or the meta leader, as the servers say at this moment, or the planned node.
func (f *faults) natsTarget(ctx context.Context, ft Fault) (*natsNode, string, error) {
	c := f.r.nats
	if ft.Kind == FaultNATSNode {
		n := c.nodes[ft.Target%len(c.nodes)]
		return n, "SIGKILL nats-" + n.name, nil
	}
	var leader, role string
	err := waitUntil(ctx, 20*time.Second, 200*time.Millisecond, "a leader to kill", func() bool {
		var err error
		switch ft.Kind {
		case FaultNATSWorkLdr:
			role = "leader of " + f.r.subjects.WorkStream()
			leader, err = c.streamLeader(ctx, f.r.subjects.WorkStream())
		case FaultNATSConsumerLdr:
			consumer := workConsumers[ft.Target%len(workConsumers)]
			role = "leader of consumer " + consumer + " of " + f.r.subjects.WorkStream()
			leader, err = c.consumerLeader(ctx, f.r.subjects.WorkStream(), consumer)
		default:
			role = "JetStream meta leader"
			leader, err = c.metaLeader(ctx)
		}
		return err == nil
	})
	if err != nil {
		return nil, "SIGKILL the " + role, err
	}
	n, err := c.node(leader)
	if err != nil {
		return nil, "SIGKILL the " + role, err
	}
	also := ""
	if m, err := c.metaLeader(ctx); ft.Kind != FaultNATSMetaLdr && err == nil && m == leader {
		also += ", also the meta leader"
	}
	if w, err := c.streamLeader(ctx, f.r.subjects.WorkStream()); ft.Kind != FaultNATSWorkLdr && err == nil && w == leader {
		also += ", also the work stream's leader"
	}
	return n, fmt.Sprintf("SIGKILL nats-%s (%s%s)", n.name, role, also), nil
}

// list returns the records in the order the faults started.
func (f *faults) list() []faultRecord {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := append([]faultRecord(nil), f.records...)
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j].Started < out[j-1].Started; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// lastEnd is when the last fault ended.
func (f *faults) lastEnd() time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	var last time.Duration
	for _, rec := range f.records {
		last = max(last, rec.Ended)
	}
	return last
}
