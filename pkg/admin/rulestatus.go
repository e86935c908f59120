package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/status"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// ruleCheckConcurrency bounds the CouchDB and NATS requests in flight while `producer status`
// checks how far the on_change rules are behind.
const ruleCheckConcurrency = 16

// RuleStatus is one rule's part of `producer status` (StatusReport.PerRule).
type RuleStatus struct {
	ID         string `json:"id"`
	Kind       string `json:"kind"`
	Pattern    string `json:"pattern"`          // the db_name regex; an exact replicator rule's db
	Engine     string `json:"engine,omitempty"` // replicator rules
	Enabled    bool   `json:"enabled"`
	DBsMatched int    `json:"dbs_matched"`

	// Enabled on_change rules, from their checkpoints: the matched dbs with changes after the
	// checkpoint, and how long the oldest of them has waited (since its db's pending job was
	// published, i.e. since the first change after the db's last completed run). Behind dbs
	// without a pending job are counted apart: the producer has not (yet) enqueued them.
	DBsBehind        *int     `json:"dbs_behind,omitempty"`
	DBsBehindNoJob   int      `json:"dbs_behind_without_job,omitempty"`
	OldestAgeSeconds *float64 `json:"oldest_unprocessed_age_seconds,omitempty"`
	OldestDB         string   `json:"oldest_unprocessed_db,omitempty"`
	DBsUnchecked     int      `json:"dbs_unchecked,omitempty"` // not checked within --timeout, or failed

	// From the running consumers' status answers (summed over instances; last run is the
	// latest of them) and the dead-letter stream.
	LastRun          *time.Time `json:"last_run,omitempty"`
	LastResult       string     `json:"last_result,omitempty"`
	LastError        string     `json:"last_error,omitempty"`
	Runs             uint64     `json:"runs"`
	FailuresLastHour int        `json:"failures_last_hour"`
	DeadLetters      int        `json:"dead_letters"`
	// Gaps found in what an on_change rule keeps for readers (a change stream's subject, a mirror
	// bucket), summed over the consumers, and the latest, naming the db and the range.
	Gaps    uint64          `json:"gaps,omitempty"`
	LastGap *status.GapNote `json:"last_gap,omitempty"`
}

// ruleChecker computes the per-rule part of `producer status`. Its work is bounded by ctx.
type ruleChecker struct {
	d         *producer.Conns
	spiegelDB string
	store     *checkpoint.OnChangeStore
	now       time.Time

	mu   sync.Mutex
	jobs map[string]*time.Time // db → publish time of its pending onchange job (nil: none)
}

// perRule returns the status of rules, in their order, as the spiegel db, the checkpoints and
// the dead-letter stream tell it (see withProcesses for the rest). incomplete, when not "", says
// what could not be done within ctx.
func (c *ruleChecker) perRule(ctx context.Context, rs []rules.Rule) (out []RuleStatus, incomplete string) {
	var notes []string
	out = make([]RuleStatus, len(rs))
	if len(rs) == 0 {
		return out, ""
	}
	for i, r := range rs {
		out[i] = describeRule(r)
	}

	// Matched dbs, from _all_dbs; the enabled on_change rules' dbs are checked.
	type task struct {
		i  int
		db string
	}
	var tasks []task
	err := c.d.Couch.EachDB(ctx, func(db string) error {
		if db == c.spiegelDB || producer.IsSystemDB(db) {
			return nil
		}
		for i, r := range rs {
			if !r.MatchesDB(db) {
				continue
			}
			out[i].DBsMatched++
			if r.Kind() == rules.KindOnChange && r.Enabled() {
				tasks = append(tasks, task{i, db})
			}
		}
		return nil
	})
	if err != nil {
		notes = append(notes, "listing the dbs stopped: "+err.Error())
	}
	for i, r := range rs {
		if r.Kind() == rules.KindOnChange && r.Enabled() {
			out[i].DBsBehind = new(int)
		}
	}

	var dl map[string]int
	var dlErr error
	var wg sync.WaitGroup
	wg.Go(func() { dl, dlErr = deadLettersByRule(ctx, c.d.JS, c.d.Topo.Subjects.DeadLetterStream()) })

	var mu sync.Mutex
	unchecked := 0
	sem := make(chan struct{}, ruleCheckConcurrency)
	var tw sync.WaitGroup
	for _, tk := range tasks {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			mu.Lock()
			out[tk.i].DBsUnchecked++
			unchecked++
			mu.Unlock()
			continue
		}
		tw.Go(func() {
			defer func() { <-sem }()
			behind, jobAt, err := c.behind(ctx, rs[tk.i].(*rules.OnChange), tk.db)
			mu.Lock()
			defer mu.Unlock()
			st := &out[tk.i]
			switch {
			case err != nil:
				st.DBsUnchecked++
				unchecked++
			case !behind:
			case jobAt == nil:
				*st.DBsBehind++
				st.DBsBehindNoJob++
			default:
				*st.DBsBehind++
				age := max(c.now.Sub(*jobAt).Seconds(), 0)
				if st.OldestAgeSeconds == nil || age > *st.OldestAgeSeconds {
					st.OldestAgeSeconds, st.OldestDB = &age, tk.db
				}
			}
		})
	}
	tw.Wait()
	wg.Wait()
	if unchecked > 0 {
		notes = append(notes, fmt.Sprintf("%d checkpoints were not checked (timeout or errors)", unchecked))
	}
	if dlErr != nil {
		notes = append(notes, "counting dead letters stopped: "+dlErr.Error())
	}
	for i := range out {
		out[i].DeadLetters = dl[out[i].ID]
	}
	if len(notes) > 0 {
		incomplete = notes[0]
		for _, n := range notes[1:] {
			incomplete += "; " + n
		}
	}
	return out, incomplete
}

// describeRule is what the rule itself tells about r.
func describeRule(r rules.Rule) RuleStatus {
	rs := RuleStatus{ID: r.ID(), Kind: r.Kind(), Enabled: r.Enabled()}
	switch x := r.(type) {
	case *rules.Replicator:
		rs.Pattern = x.ExactDB
		if x.Pattern != nil {
			rs.Pattern = x.Pattern.String()
		}
		rs.Engine = x.Engine
	case *rules.OnChange:
		if x.DBPattern != nil {
			rs.Pattern = x.DBPattern.String()
		}
	}
	return rs
}

// withProcesses adds to out what the running consumers (procs) say about each rule: the
// default engine of replicator rules that name none, and the runs summed over the instances
// that ran the rule (the last run is the latest of theirs).
func withProcesses(out []RuleStatus, procs []status.Report) {
	defaultEngine := "default"
	for _, p := range procs {
		if p.Component == status.ComponentReplicator && p.DefaultEngine != "" {
			defaultEngine = p.DefaultEngine + " (default)"
			break
		}
	}
	for i := range out {
		rs := &out[i]
		component := status.ComponentOnChange
		if rs.Kind == rules.KindReplicator {
			component = status.ComponentReplicator
			if rs.Engine == "" {
				rs.Engine = defaultEngine
			}
		}
		for _, p := range procs {
			st, ok := p.RuleStats[rs.ID]
			if p.Component != component || !ok {
				continue
			}
			rs.Runs += st.Runs
			rs.FailuresLastHour += st.FailuresLastHour
			rs.Gaps += st.Gaps
			if g := st.LastGap; g != nil && (rs.LastGap == nil || g.At.After(rs.LastGap.At)) {
				rs.LastGap = g
			}
			if rs.LastRun == nil || st.LastRun.After(*rs.LastRun) {
				at := st.LastRun
				rs.LastRun, rs.LastResult, rs.LastError = &at, st.LastResult, st.LastError
			}
		}
	}
}

// behind reports whether rule r has changes to act on in db (changes after its checkpoint),
// and if so, when db's pending onchange job was published (nil: none pending). A db gone
// meanwhile is not behind.
func (c *ruleChecker) behind(ctx context.Context, r *rules.OnChange, db string) (bool, *time.Time, error) {
	cp, err := c.store.Load(ctx, r.ID(), db)
	if err != nil {
		return false, nil, err
	}
	if !cp.Found && r.Since == rules.SinceNow {
		return false, nil, nil // the rule starts at the db's end on its first run
	}
	page, err := c.d.Couch.Changes(ctx, db, couch.ChangesOptions{Since: cp.LastSeq, Limit: 1})
	if errors.Is(err, couch.ErrNotFound) {
		return false, nil, nil
	}
	if err != nil {
		return false, nil, err
	}
	if len(page.Results) == 0 {
		return false, nil, nil
	}
	at, err := c.pendingJob(ctx, db)
	return true, at, err
}

// pendingJob returns when db's pending onchange job was published (nil: none), once per db.
func (c *ruleChecker) pendingJob(ctx context.Context, db string) (*time.Time, error) {
	c.mu.Lock()
	at, ok := c.jobs[db]
	c.mu.Unlock()
	if ok {
		return at, nil
	}
	s, err := c.d.JS.Stream(ctx, c.d.Topo.Subjects.WorkStream())
	if err != nil {
		return nil, err
	}
	m, err := s.GetLastMsgForSubject(ctx, c.d.Topo.Subjects.Work(events.GroupOnChange, db))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		at = nil
	case err != nil:
		return nil, err
	default:
		t := m.Time
		at = &t
	}
	c.mu.Lock()
	c.jobs[db] = at
	c.mu.Unlock()
	return at, nil
}

// deadLettersByRule counts the records of the dead-letter stream by rule, reading the stream
// once with an ordered consumer (within ctx).
func deadLettersByRule(ctx context.Context, js jetstream.JetStream, stream string) (map[string]int, error) {
	out := map[string]int{}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return out, err
	}
	if s.CachedInfo().State.Msgs == 0 {
		return out, nil
	}
	// The read ends at the stream's last message when it began: not at a pending count of 0,
	// which a clustered server can send early.
	last := s.CachedInfo().State.LastSeq
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return out, err
	}
	for {
		batch, err := cons.FetchNoWait(512)
		if err != nil {
			return out, err
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			var rec worker.DeadLetter
			if json.Unmarshal(msg.Data(), &rec) == nil && rec.Rule != "" {
				out[rec.Rule]++
			}
			if meta, err := msg.Metadata(); err == nil && meta.Sequence.Stream >= last {
				return out, nil
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return out, err
		}
		if n == 0 { // the rest was deleted meanwhile
			return out, ctx.Err()
		}
		if ctx.Err() != nil {
			return out, ctx.Err()
		}
	}
}

// openRuleChecker returns a checker over d's servers.
func openRuleChecker(ctx context.Context, d *producer.Conns, spiegelDB string) (*ruleChecker, error) {
	kv, err := natsjs.OnChangeBucket(ctx, d.JS, d.Topo)
	if err != nil {
		return nil, err
	}
	return &ruleChecker{d: d, spiegelDB: spiegelDB, store: checkpoint.NewOnChangeStore(d.Couch, kv), now: time.Now(),
		jobs: map[string]*time.Time{}}, nil
}
