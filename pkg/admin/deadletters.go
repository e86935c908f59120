package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// Record is a dead-letter record with its id: its sequence in the dead-letter stream.
type Record struct {
	ID uint64 `json:"id"`
	worker.DeadLetter
}

// Filter selects dead-letter records.
type Filter struct {
	Group  events.Group
	Rule   string
	DB     *regexp.Regexp
	Since  time.Duration // only records at most this old (0: all)
	Before uint64        // only records with a smaller id (0: all): the next page
	Limit  int           // at most this many, newest first (0: all)
}

func (f Filter) match(r Record) bool {
	return (f.Group == "" || r.Group == f.Group) && (f.Rule == "" || r.Rule == f.Rule) &&
		(f.DB == nil || f.DB.MatchString(r.DB)) && (f.Before == 0 || r.ID < f.Before)
}

// DeadLetterSpan is how many stream sequences one read of EachDeadLetter covers: what it holds in
// memory at most, whatever the size of the stream.
const DeadLetterSpan = 1000

// EachDeadLetter calls fn with each record f selects (f.Limit aside), newest first, until fn
// returns false. It reads the stream backwards, one span of DeadLetterSpan sequences at a time
// through a short-lived consumer (filtered on the group's subjects), so that memory holds one
// span, and a full page or a record older than f.Since ends the reading early.
func EachDeadLetter(ctx context.Context, stream jetstream.Stream, subjects events.Subjects, f Filter, fn func(Record) bool) error {
	info, err := stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("read dead letters: %w", err)
	}
	st := info.State
	if st.Msgs == 0 {
		return nil
	}
	end := st.LastSeq + 1
	if f.Before > 0 && f.Before < end {
		end = f.Before
	}
	var oldest time.Time
	if f.Since > 0 {
		oldest = time.Now().Add(-f.Since)
	}
	filter := subjects.DeadLetterAll()
	if f.Group != "" {
		filter = strings.TrimSuffix(subjects.DeadLetterAll(), ">") + string(f.Group) + ".>"
	}
	for end > st.FirstSeq {
		start := st.FirstSeq
		if end-st.FirstSeq > DeadLetterSpan {
			start = end - DeadLetterSpan
		}
		recs, older, err := readSpan(ctx, stream, filter, start, end, oldest)
		if err != nil {
			return err
		}
		for _, r := range slices.Backward(recs) {
			if f.match(r) && !fn(r) {
				return nil
			}
		}
		if older {
			return nil
		}
		end = start
	}
	return nil
}

// readSpan reads the records on filter with sequences in [start, end), oldest first, leaving out
// those older than oldest (older then reports that there were some).
func readSpan(ctx context.Context, stream jetstream.Stream, filter string, start, end uint64, oldest time.Time) (recs []Record, older bool, err error) {
	c, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		FilterSubject: filter, AckPolicy: jetstream.AckNonePolicy, InactiveThreshold: time.Minute, MemoryStorage: true,
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: start,
	})
	if err != nil {
		return nil, false, fmt.Errorf("read dead letters: %w", err)
	}
	defer func() { _ = stream.DeleteConsumer(context.WithoutCancel(ctx), c.CachedInfo().Name) }()
	left := c.CachedInfo().NumPending // from start to the end of the stream
	for left > 0 {
		batch, err := c.Fetch(int(min(left, DeadLetterSpan)), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return nil, false, fmt.Errorf("read dead letters: %w", err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			meta, err := m.Metadata()
			if err != nil {
				return nil, false, fmt.Errorf("read dead letters: %w", err)
			}
			if meta.Sequence.Stream >= end {
				left = 0
				continue
			}
			if meta.Timestamp.Before(oldest) {
				older = true
				continue
			}
			r := Record{ID: meta.Sequence.Stream}
			if err := json.Unmarshal(m.Data(), &r.DeadLetter); err != nil {
				r.Error = fmt.Sprintf("unreadable record on %s: %v", m.Subject(), err)
			}
			recs = append(recs, r)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, false, fmt.Errorf("read dead letters: %w", err)
		}
		if n == 0 {
			return nil, false, fmt.Errorf("read dead letters: %d records announced but none came", left)
		}
		left -= min(uint64(n), left)
	}
	return recs, older, nil
}

// DeleteRecord deletes the dead-letter record id from stream (gone already: done).
func DeleteRecord(ctx context.Context, stream jetstream.Stream, id uint64) error {
	err := stream.DeleteMsg(ctx, id)
	if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("delete dead letter %d: %w", id, err)
	}
	return nil
}

// Redrive is what retry does for the records of one (group, rule, db).
type Redrive struct {
	Group    events.Group
	Rule, DB string
	Since    string // on_change: where the rule resumes in db ("": the checkpoint stays)
	Recs     []Record
	Skip     string // why the records are kept rather than re-driven
}

// PlanRedrives groups recs by (group, rule, db), oldest record first, and decides what each
// group's retry does: an on_change rule resumes from the earliest resume point among its records
// (the seq just before the earliest failed change); a replicator db gets a job.
func PlanRedrives(recs []Record, set *rules.Set) []*Redrive {
	byKey := map[string]*Redrive{}
	var plans []*Redrive
	for _, r := range slices.Backward(recs) {
		key := string(r.Group) + "\x00" + r.Rule + "\x00" + r.DB
		p := byKey[key]
		if p == nil {
			p = &Redrive{Group: r.Group, Rule: r.Rule, DB: r.DB}
			byKey[key] = p
			plans = append(plans, p)
		}
		p.Recs = append(p.Recs, r)
	}
	for _, p := range plans {
		rule, ok := set.Rule(p.Rule)
		switch {
		case p.Rule == "":
			p.Skip = "the record names no rule"
		case !ok || !rule.Enabled():
			p.Skip = fmt.Sprintf("rule %q no longer exists, is invalid or is disabled", p.Rule)
		case !rule.MatchesDB(p.DB):
			p.Skip = fmt.Sprintf("rule %q no longer matches the db", p.Rule)
		case rule.Group() != p.Group:
			p.Skip = fmt.Sprintf("rule %q is now of kind %s", p.Rule, rule.Kind())
		case p.Group == events.GroupOnChange:
			for _, r := range p.Recs {
				switch {
				case r.Since != "" && (p.Since == "" || seqAfter(p.Since, r.Since)):
					p.Since = r.Since
				case r.Since == "" && r.Seq != "":
					p.Skip = fmt.Sprintf("record %d was written without a resume point: use producer replay --rule %s --db '^%s$' --since <the seq before %s>",
						r.ID, p.Rule, regexp.QuoteMeta(p.DB), r.Seq)
				}
			}
		}
	}
	return plans
}

// seqAfter reports whether seq a is after seq b in one db's feed, comparing the numbers that
// lead both PouchDB's and CouchDB's seqs (CouchDB's is the sum of its shards' positions, which
// only grows along a feed). When either has no number it answers true: a re-drive then moves
// back rather than risk skipping a change.
func seqAfter(a, b string) bool {
	na, errA := strconv.ParseUint(leadingDigits(a), 10, 64)
	nb, errB := strconv.ParseUint(leadingDigits(b), 10, 64)
	if errA != nil || errB != nil {
		return true
	}
	return na > nb
}

func leadingDigits(s string) string {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return s[:i]
}

// Redriver carries out redrive plans.
type Redriver struct {
	couch  *couch.Client
	store  *checkpoint.OnChangeStore
	jobs   *natsjs.Jobs
	stream jetstream.Stream
}

// NewRedriver returns a Redriver over d's servers that deletes re-driven records from stream.
func NewRedriver(ctx context.Context, d *producer.Conns, stream jetstream.Stream) (*Redriver, error) {
	kv, err := natsjs.OnChangeBucket(ctx, d.JS, d.Topo)
	if err != nil {
		return nil, err
	}
	return &Redriver{couch: d.Couch, store: checkpoint.NewOnChangeStore(d.Couch, kv), jobs: natsjs.NewJobs(d.JS, d.Topo.Subjects), stream: stream}, nil
}

// Run carries out plans, calling report with each once it is done (Skip then says why its
// records are kept), and returns how many records it re-drove and deleted, and how many it kept.
// Records are deleted only once their job is enqueued (a pending job is as good: it runs from the
// checkpoint just moved).
func (rd *Redriver) Run(ctx context.Context, plans []*Redrive, report func(*Redrive)) (redriven, kept int, err error) {
	for _, p := range plans {
		if p.Skip == "" {
			if err := rd.redrive(ctx, p); err != nil {
				if ctx.Err() != nil {
					return redriven, kept, err
				}
				p.Skip = err.Error()
			}
		}
		report(p)
		if p.Skip != "" {
			kept += len(p.Recs)
			continue
		}
		for _, r := range p.Recs {
			if err := DeleteRecord(ctx, rd.stream, r.ID); err != nil {
				return redriven, kept, err
			}
		}
		redriven += len(p.Recs)
	}
	return redriven, kept, nil
}

func (rd *Redriver) redrive(ctx context.Context, p *Redrive) error {
	if _, err := rd.couch.DBInfo(ctx, p.DB); errors.Is(err, couch.ErrNotFound) {
		return errors.New("the db no longer exists")
	} else if err != nil {
		return fmt.Errorf("read db %s: %w", p.DB, err)
	}
	if p.Since != "" {
		cur, err := rd.store.Load(ctx, p.Rule, p.DB)
		if err != nil {
			return err
		}
		// No checkpoint: the rule would start at its own start (maybe "now"). A checkpoint at the
		// beginning, or before the resume point, reaches the changes anyway.
		if !cur.Found || cur.LastSeq != "" && seqAfter(cur.LastSeq, p.Since) {
			if err := rd.store.Reset(ctx, p.Rule, p.DB, p.Since); err != nil {
				return err
			}
		}
	}
	_, err := rd.jobs.Offer(ctx, p.Group, events.Job{DB: p.DB, Reason: events.ReasonResync, At: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("enqueue %s: %w", p.DB, err)
	}
	return nil
}
