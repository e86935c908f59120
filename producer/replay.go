package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"regexp"
	"sort"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// defaultReplayWait is how long `producer replay` waits for the consumers to finish.
const defaultReplayWait = 10 * time.Minute

// replayIDPattern is what a replay id may look like: it is part of message ids and subjects'
// headers, and of the checkpoint's replay mark (space-separated).
var replayIDPattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// newReplayID returns a new replay id: the UTC time and 4 random bytes, e.g. 20261125T170512Z-1a2b3c4d.
func newReplayID(now time.Time) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return now.UTC().Format("20060102T150405Z") + "-" + hex.EncodeToString(b)
}

const replayHelp = `Reset the checkpoints of the on_change rule ID (in the dbs it matches, optionally only those
matching REGEX) to the beginning or to SEQ, and enqueue those dbs, so the rule's history is
dispatched again. A subject rule publishes it again under the replay's id (printed; --id to
resume or repeat a replay without storing any change twice): message id
replay/<id>/<db>/<doc id>/<rev>, header Spiegel-Replay: <id>. The command then waits (--wait,
default 10m; 0: no wait) until every db's replay reached the end of its feed and prints per db
how many changes it re-dispatched; it exits 1 when a db is not done in time. --json: {"id",
"rule", "dbs": [{"db", "state", "redispatched"}], "total"} ("redispatched" and "total" for a
subject rule only).`

type replayOpts struct {
	rule, since, id string
	db              *regexp.Regexp
	wait            time.Duration
	resumed, json   bool
}

type replayFlagValues struct {
	rule, db, since, id *string
	wait                *time.Duration
	json                *bool
}

func replayFlags(fs *flag.FlagSet) replayFlagValues {
	return replayFlagValues{
		rule:  fs.String("rule", "", "the on_change rule to replay (`ID`, required)"),
		db:    fs.String("db", "", "only dbs matching this `REGEX` (RE2)"),
		since: fs.String("since", "", "restart from this `SEQ` instead of the beginning"),
		id: fs.String("id", "", "the replay's `ID` (letters, digits, - and _); again to resume or repeat a replay "+
			"without duplicates (default: a new one)"),
		wait: fs.Duration("wait", defaultReplayWait, "how long to wait for the consumers to finish the replay and "+
			"count what it re-dispatched (0: do not wait)"),
		json: fs.Bool("json", false, "print the result as JSON"),
	}
}

// parseReplay parses replay's command line; it makes up a new replay id unless --id is given.
func parseReplay(args []string) (*replayOpts, error) {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	f := replayFlags(fs)
	if err := parseFlags(fs, args, false); err != nil {
		return nil, err
	}
	o := &replayOpts{rule: *f.rule, since: *f.since, id: *f.id, wait: *f.wait, json: *f.json, resumed: *f.id != ""}
	if o.rule == "" {
		return nil, usageError{errors.New("--rule is required")}
	}
	if !o.resumed {
		o.id = newReplayID(time.Now())
	} else if !replayIDPattern.MatchString(o.id) {
		return nil, usageError{fmt.Errorf("--id %q: use 1 to 64 letters, digits, '-' or '_'", o.id)}
	}
	if o.wait < 0 {
		return nil, usageError{fmt.Errorf("--wait %s: must not be negative", o.wait)}
	}
	var err error
	o.db, err = dbFlagRegexp(*f.db)
	return o, err
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
	o, err := parseReplay(cio.args)
	if err != nil {
		return err
	}
	d, set, err := admin.Open(ctx, cfg, log, 1024)
	if err != nil {
		return err
	}
	defer func() { _ = d.NC.Drain() }()
	r, ok := set.Rule(o.rule)
	oc, isOnChange := r.(*rules.OnChange)
	if !ok || !isOnChange {
		return fmt.Errorf("replay: no valid on_change rule %q in %s", o.rule, cfg.DBName)
	}
	kv, err := natsjs.OnChangeBucket(ctx, d.JS, d.Topo)
	if err != nil {
		return err
	}
	store := checkpoint.NewOnChangeStore(d.Couch, kv)
	store.ReplayID = o.id

	var counter *admin.ReplayCounter
	if oc.Subject != "" && o.wait > 0 {
		if counter, err = admin.NewReplayCounter(ctx, d.JS, oc, o.id, o.resumed); err != nil {
			return err
		}
	}
	fmt.Fprintf(cio.stderr, "replay %s of rule %s (again with --id %s to resume it without duplicates)\n", o.id, oc.ID(), o.id)

	var mu sync.Mutex
	var dbs, failed []string
	var pr progress
	err = enqueueDBs(ctx, d, func(db string) []events.Group {
		if db == cfg.DBName || producer.IsSystemDB(db) || !oc.MatchesDB(db) || o.db != nil && !o.db.MatchString(db) {
			return nil
		}
		if err := admin.ResetForReplay(ctx, store, oc.ID(), db, o.since); err != nil {
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
			o.id, len(failed), failed[0], o.id)
	}
	if err != nil || o.wait == 0 {
		if err == nil && o.json {
			return printJSON(cio.stdout, map[string]any{"id": o.id, "rule": oc.ID(), "dbs_enqueued": len(dbs)})
		}
		return err
	}
	sort.Strings(dbs)
	states := admin.WaitReplay(ctx, store, oc.ID(), o.id, dbs, o.wait, func(done, total int) {
		fmt.Fprintf(cio.stderr, "replay: %d of %d dbs done\n", done, total)
	})
	var counts map[string]int
	if counter != nil {
		if counts, err = counter.Count(ctx); err != nil {
			return err
		}
	}
	if o.json {
		return printReplayJSON(cio, o.id, oc.ID(), dbs, states, counts, counter != nil, o.wait)
	}
	return printReplay(cio, o.id, dbs, states, counts, counter != nil, o.wait)
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
		if states[db] == admin.ReplayRunning {
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

// replayDB is one db of `replay --json`.
type replayDB struct {
	DB           string `json:"db"`
	State        string `json:"state"`
	Redispatched *int   `json:"redispatched,omitempty"`
}

// printReplayJSON is printReplay's --json form.
func printReplayJSON(cio cmdIO, id, rule string, dbs []string, states map[string]string, counts map[string]int, counted bool, wait time.Duration) error {
	rows := make([]replayDB, 0, len(dbs))
	total, running := 0, 0
	for _, db := range dbs {
		row := replayDB{DB: db, State: states[db]}
		if counted {
			n := counts[db]
			row.Redispatched = &n
			total += n
		}
		if states[db] == admin.ReplayRunning {
			running++
		}
		rows = append(rows, row)
	}
	out := map[string]any{"id": id, "rule": rule, "dbs": rows}
	if counted {
		out["total"] = total
	}
	if err := printJSON(cio.stdout, out); err != nil {
		return err
	}
	if running > 0 {
		return fmt.Errorf("replay %s: %d of %d dbs not done within --wait %s (the consumers go on; run it again with --id %s to wait and count again)",
			id, running, len(dbs), wait, id)
	}
	return nil
}
