package admin

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
)

// collectWait bounds how long `producer status` waits for the running processes' answers
// (status.Collect returns earlier once they stop coming).
const collectWait = 2 * time.Second

// StatusReport is what `producer status` prints.
type StatusReport struct {
	Rules struct {
		Replicators int               `json:"replicators"`
		OnChanges   int               `json:"on_changes"`
		Disabled    int               `json:"disabled"`
		Rejected    map[string]string `json:"rejected"`
	} `json:"rules"`
	Groups      map[string]GroupStatus `json:"groups"`
	DeadLetters uint64                 `json:"dead_letters"`
	Position    *checkpoint.Position   `json:"producer_position,omitempty"`
	// Processes are the answers of the running producers and consumers (their NATS services).
	Processes []status.Report `json:"processes"`
	// PerRule is every rule's status (only --rule's with that flag), by id.
	PerRule []RuleStatus `json:"per_rule"`
	// Incomplete, when set, says what of PerRule could not be gathered within --timeout.
	Incomplete string `json:"per_rule_incomplete,omitempty"`
}

// GroupStatus is the jobs of one group (its durable consumer on the work stream).
type GroupStatus struct {
	Pending     uint64 `json:"pending"`
	InFlight    int    `json:"in_flight"`
	Redelivered int    `json:"redelivered"`
}

// Status gathers the status report of the installation of d, whose rules are set: rules, jobs
// and the producer's position, then the running processes and every rule's status (only ruleID's
// when not ""; see RuleStatus), within d.Cfg.AdminTimeout. It holds nothing secret.
func Status(ctx context.Context, d *producer.Conns, set *rules.Set, ruleID string) (*StatusReport, error) {
	cfg := d.Cfg
	var rep StatusReport
	st := set.Stats()
	selected := set.All()
	if ruleID != "" {
		r, ok := set.Rule(ruleID)
		_, rejected := st.RejectedIDs[ruleID]
		if !ok && !rejected {
			return nil, fmt.Errorf("status: no rule %q in %s", ruleID, cfg.DBName)
		}
		selected = nil
		if ok {
			selected = []rules.Rule{r}
		}
	}
	timeout := cfg.AdminTimeout
	if timeout <= 0 {
		timeout = defaultAdminTimeout
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var collectErr error
	var wg sync.WaitGroup
	wg.Go(func() {
		rep.Processes, collectErr = status.Collect(wctx, d.NC, cfg.SubjectPrefix, min(timeout, collectWait))
	})
	checker, err := openRuleChecker(wctx, d, cfg.DBName)
	if err != nil {
		return nil, err
	}
	rep.PerRule, rep.Incomplete = checker.perRule(wctx, selected)
	wg.Wait()
	if collectErr != nil {
		return nil, collectErr
	}
	withProcesses(rep.PerRule, rep.Processes)
	if rep.Processes == nil {
		rep.Processes = []status.Report{}
	}
	rep.Rules.Replicators, rep.Rules.OnChanges, rep.Rules.Disabled = st.Replicators, st.OnChanges, st.Disabled
	rep.Rules.Rejected = st.RejectedIDs
	rep.Groups = map[string]GroupStatus{}
	for _, g := range events.Groups {
		c, err := d.JS.Consumer(ctx, d.Topo.Subjects.WorkStream(), g.ConsumerName())
		if err != nil {
			return nil, fmt.Errorf("read consumer %s: %w", g.ConsumerName(), err)
		}
		info, err := c.Info(ctx)
		if err != nil {
			return nil, fmt.Errorf("read consumer %s: %w", g.ConsumerName(), err)
		}
		rep.Groups[string(g)] = GroupStatus{Pending: info.NumPending, InFlight: info.NumAckPending, Redelivered: info.NumRedelivered}
	}
	if s, err := d.JS.Stream(ctx, d.Topo.Subjects.DeadLetterStream()); err == nil {
		rep.DeadLetters = s.CachedInfo().State.Msgs
	}
	if pos, err := checkpoint.NewStore(d.Couch, cfg.DBName).Position(ctx); err == nil {
		rep.Position = &pos
	}
	return &rep, nil
}
