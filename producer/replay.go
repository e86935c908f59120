package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

const (
	// defaultReplayWait is how long `producer replay` waits for the consumers to finish.
	defaultReplayWait = 10 * time.Minute
	// replayPoll is how often `producer replay` reads the checkpoints while it waits (liveness
	// only: a replay is done when its checkpoint says so).
	replayPoll = 500 * time.Millisecond
)

// replayIDPattern is what a replay id may look like: it is part of message ids and subjects'
// headers, and of the checkpoint's replay mark (space-separated).
var replayIDPattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// newReplayID returns a new replay id: the UTC time and 4 random bytes, e.g. 20261125T170512Z-1a2b3c4d.
func newReplayID(now time.Time) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return now.UTC().Format("20060102T150405Z") + "-" + hex.EncodeToString(b)
}

// runReplay dispatches an on_change rule's history again: it resets the rule's checkpoints (in the
// dbs it matches, and --db) to the beginning or --since, marked with the replay's id, and
// enqueues those dbs; the onchange consumers then act on the changes again. A subject rule
// publishes them under the replay's id (message id replay/<id>/<db>/<doc id>/<rev>, header
// Spiegel-Replay: <id>), so that the stream stores them again, once per replay. Unless --wait is
// 0 the command then waits until every db's run has reached the end of its feed and prints, per
// db, how many changes the replay stored in the subject's stream.
//
// Running the command again with the same --id resumes or repeats that replay without storing
// any of its changes twice (within the stream's duplicate window); two replays with different
// ids each store their copy.
func runReplay(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.SetOutput(cio.stderr)
	ruleID := fs.String("rule", "", "the on_change rule to replay (required)")
	dbRE := fs.String("db", "", "only dbs matching this RE2 regex")
	since := fs.String("since", "", "restart from this seq instead of the beginning")
	id := fs.String("id", "", "the replay's id (letters, digits, - and _); again to resume or repeat a replay without duplicates (default: a new one)")
	wait := fs.Duration("wait", defaultReplayWait, "how long to wait for the consumers to finish the replay and count what it re-dispatched (0: do not wait)")
	if err := fs.Parse(cio.args); err != nil {
		return usageError{err}
	}
	if *ruleID == "" {
		return usageError{errors.New("--rule is required")}
	}
	resumed := *id != ""
	if !resumed {
		*id = newReplayID(time.Now())
	} else if !replayIDPattern.MatchString(*id) {
		return usageError{fmt.Errorf("--id %q: use 1 to 64 letters, digits, '-' or '_'", *id)}
	}
	if *wait < 0 {
		return usageError{fmt.Errorf("--wait %s: must not be negative", *wait)}
	}
	re, err := dbFlagRegexp(*dbRE)
	if err != nil {
		return err
	}
	d, set, err := openAdmin(ctx, cfg, log, 1024)
	if err != nil {
		return err
	}
	defer func() { _ = d.NC.Drain() }()
	r, ok := set.Rule(*ruleID)
	oc, isOnChange := r.(*rules.OnChange)
	if !ok || !isOnChange {
		return fmt.Errorf("replay: no valid on_change rule %q in %s", *ruleID, cfg.DBName)
	}
	kv, err := natsjs.OnChangeBucket(ctx, d.JS, d.Topo)
	if err != nil {
		return err
	}
	store := checkpoint.NewOnChangeStore(d.Couch, kv)
	store.ReplayID = *id

	var counter *replayCounter
	if oc.Subject != "" && *wait > 0 {
		if counter, err = newReplayCounter(ctx, d.JS, oc, *id, resumed); err != nil {
			return err
		}
	}
	fmt.Fprintf(cio.stderr, "replay %s of rule %s (again with --id %s to resume it without duplicates)\n", *id, oc.ID(), *id)

	var mu sync.Mutex
	var dbs, failed []string
	var pr progress
	err = enqueueDBs(ctx, d, func(db string) []events.Group {
		if db == cfg.DBName || producer.IsSystemDB(db) || !oc.MatchesDB(db) || re != nil && !re.MatchString(db) {
			return nil
		}
		if err := resetForReplay(ctx, store, oc.ID(), db, *since); err != nil {
			log.WithFields(logrus.Fields{"rule": oc.ID(), "db": db}).WithError(err).Warn("reset checkpoint")
			mu.Lock()
			failed = append(failed, db)
			mu.Unlock()
			return nil
		}
		mu.Lock()
		dbs = append(dbs, db)
		mu.Unlock()
		return []events.Group{events.GroupOnChange}
	}, events.ReasonResync, &pr, cio)
	if err == nil && len(failed) > 0 {
		err = fmt.Errorf("replay %s: the checkpoint of %d dbs could not be reset (see the log), e.g. %s; run it again with --id %s",
			*id, len(failed), failed[0], *id)
	}
	if err != nil || *wait == 0 {
		return err
	}
	sort.Strings(dbs)
	states := waitReplay(ctx, store, oc.ID(), *id, dbs, *wait, cio)
	var counts map[string]int
	if counter != nil {
		if counts, err = counter.count(ctx); err != nil {
			return err
		}
	}
	return printReplay(cio, *id, dbs, states, counts, counter != nil, *wait)
}

// resetForReplay resets rule's checkpoint in db, trying again a few times: two commands
// resetting one checkpoint at once (a replay run twice) make one of the writes conflict.
func resetForReplay(ctx context.Context, store *checkpoint.OnChangeStore, rule, db, since string) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		if err = store.Reset(ctx, rule, db, since); err == nil || ctx.Err() != nil {
			return err
		}
	}
	return err
}

// Where a db's part of a replay stands.
const (
	replayRunning    = "running"
	replayDone       = "done"
	replaySuperseded = "superseded" // another replay reset the checkpoint since
	replayGone       = "gone"       // the checkpoint is gone: the db was deleted
)

// waitReplay waits, for at most wait, until every db's checkpoint says that the replay reached
// the end of its feed (or that it cannot: another replay reset it, the db is gone). It returns
// each db's state.
func waitReplay(ctx context.Context, store *checkpoint.OnChangeStore, rule, id string, dbs []string, wait time.Duration, cio cmdIO) map[string]string {
	states := make(map[string]string, len(dbs))
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	ticker := time.NewTicker(replayPoll)
	defer ticker.Stop()
	last := time.Now()
	for {
		running := 0
		for _, db := range dbs {
			if s := states[db]; s != "" && s != replayRunning {
				continue
			}
			p, err := store.Load(ctx, rule, db)
			switch got, active := p.Replay(); {
			case err != nil:
				states[db] = replayRunning // asked again next time
			case !p.Found:
				states[db] = replayGone
			case got != id:
				states[db] = replaySuperseded
			case active:
				states[db] = replayRunning
			default:
				states[db] = replayDone
			}
			if states[db] == replayRunning {
				running++
			}
		}
		if running == 0 {
			return states
		}
		if time.Since(last) >= 5*time.Second {
			last = time.Now()
			fmt.Fprintf(cio.stderr, "replay: %d of %d dbs done\n", len(dbs)-running, len(dbs))
		}
		select {
		case <-ctx.Done():
			return states
		case <-ticker.C:
		}
	}
}

// printReplay prints each db's state and, for a subject rule, how many changes the replay stored;
// it fails when a db is not done within wait.
func printReplay(cio cmdIO, id string, dbs []string, states map[string]string, counts map[string]int, counted bool, wait time.Duration) error {
	w := tabwriter.NewWriter(cio.stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "db\treplay\tre-dispatched")
	total, running := 0, 0
	for _, db := range dbs {
		n := "-"
		if counted {
			n = fmt.Sprint(counts[db])
			total += counts[db]
		}
		if states[db] == replayRunning {
			running++
		}
		fmt.Fprintf(w, "%s\t%s\t%s\n", db, states[db], n)
	}
	if counted {
		fmt.Fprintf(w, "total\t%d dbs\t%d\n", len(dbs), total)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if running > 0 {
		return fmt.Errorf("replay %s: %d of %d dbs not done within --wait %s (the consumers go on; run it again with --id %s to wait and count again)",
			id, running, len(dbs), wait, id)
	}
	return nil
}

// replayCounter counts the messages a replay stored in the stream of a subject rule.
type replayCounter struct {
	js     jetstream.JetStream
	stream string
	filter string // "" = the whole stream
	id     string
	start  jetstream.ConsumerConfig
}

// newReplayCounter notes where the replay's messages start in the rule's stream: after the
// stream's last message now, or, for a replay resumed by id, within the stream's duplicate
// window (older messages cannot hold back the replay's publishes anyway).
func newReplayCounter(ctx context.Context, js jetstream.JetStream, rule *rules.OnChange, id string, resumed bool) (*replayCounter, error) {
	c := &replayCounter{js: js, id: id, filter: subjectFilter(rule.Subject)}
	probe := c.filter
	if probe == "" {
		probe = rules.Interpolate(rule.Subject, rules.Vars{DBName: "x"}, false)
	}
	name, err := js.StreamNameBySubject(ctx, probe)
	if err != nil {
		return nil, fmt.Errorf("replay: find the stream of subject %s: %w", probe, err)
	}
	st, err := js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("replay: read stream %s: %w", name, err)
	}
	info := st.CachedInfo()
	c.stream = name
	c.start = jetstream.ConsumerConfig{DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: info.State.LastSeq + 1}
	if resumed {
		from := time.Now().Add(-info.Config.Duplicates)
		c.start = jetstream.ConsumerConfig{DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &from}
	}
	return c, nil
}

// subjectFilter is the filter of every subject of template: ${db_name} as the wildcard "*"; ""
// when ${db_name} is only part of a token (no filter can say that).
func subjectFilter(template string) string {
	f := rules.Interpolate(template, rules.Vars{DBName: "*"}, false)
	for _, tok := range strings.Split(f, ".") {
		if strings.Contains(tok, "*") && tok != "*" {
			return ""
		}
	}
	return f
}

// count reads the rule's messages stored since the start noted and counts, per db, those of the
// replay.
func (c *replayCounter) count(ctx context.Context) (map[string]int, error) {
	st, err := c.js.Stream(ctx, c.stream)
	if err != nil {
		return nil, fmt.Errorf("replay: read stream %s: %w", c.stream, err)
	}
	last := st.CachedInfo().State.LastSeq
	counts := map[string]int{}
	if st.CachedInfo().State.Msgs == 0 || c.start.DeliverPolicy == jetstream.DeliverByStartSequencePolicy && c.start.OptStartSeq > last {
		return counts, nil
	}
	occ := jetstream.OrderedConsumerConfig{DeliverPolicy: c.start.DeliverPolicy, OptStartSeq: c.start.OptStartSeq, OptStartTime: c.start.OptStartTime}
	if c.filter != "" {
		occ.FilterSubjects = []string{c.filter}
	}
	cons, err := st.OrderedConsumer(ctx, occ)
	if err != nil {
		return nil, fmt.Errorf("replay: read stream %s: %w", c.stream, err)
	}
	for {
		batch, err := cons.Fetch(256, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return nil, fmt.Errorf("replay: read stream %s: %w", c.stream, err)
		}
		n, done := 0, false
		for m := range batch.Messages() {
			n++
			if md, err := m.Metadata(); err == nil && md.Sequence.Stream >= last {
				done = true
			}
			if m.Headers().Get(events.ReplayHeader) != c.id {
				continue
			}
			var body struct {
				DB string `json:"db"`
			}
			if json.Unmarshal(m.Data(), &body) == nil {
				counts[body.DB]++
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return nil, fmt.Errorf("replay: read stream %s: %w", c.stream, err)
		}
		if done || n == 0 { // n == 0: no message of the filter after the last one read
			return counts, nil
		}
	}
}
