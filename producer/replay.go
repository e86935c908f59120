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
	d, set, err := admin.Open(ctx, cfg, log, 1024)
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

	var counter *admin.ReplayCounter
	if oc.Subject != "" && *wait > 0 {
		if counter, err = admin.NewReplayCounter(ctx, d.JS, oc, *id, resumed); err != nil {
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
		if err := admin.ResetForReplay(ctx, store, oc.ID(), db, *since); err != nil {
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
	states := admin.WaitReplay(ctx, store, oc.ID(), *id, dbs, *wait, func(done, total int) {
		fmt.Fprintf(cio.stderr, "replay: %d of %d dbs done\n", done, total)
	})
	var counts map[string]int
	if counter != nil {
		if counts, err = counter.Count(ctx); err != nil {
			return err
		}
	}
	return printReplay(cio, *id, dbs, states, counts, counter != nil, *wait)
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
