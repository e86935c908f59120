package admin

import (
	"bytes"
	"cmp"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
	"github.com/spiegel-nats/spiegel/pkg/rulefeed"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

//go:embed validate.js
var validateDocUpdate string

// designDocID holds the spiegel db's validate_doc_update.
const designDocID = "_design/spiegel"

// Install creates everything Spiegel needs on d's servers that is missing, printing each step to
// out. Streams, key-value buckets and consumers that exist are left as they are (SPEC §3 "Hands
// off"): install prints each setting in which one differs from what it would create, and with
// update applies those that JetStream can change in place (installObjects). Every step tolerates
// "already there", so it is idempotent and safe to run from several processes at once.
func Install(ctx context.Context, d *producer.Conns, update bool, out io.Writer) error {
	if err := ensureDB(ctx, d.Couch, d.Cfg.DBName); err != nil {
		return err
	}
	fmt.Fprintf(out, "spiegel db %q: present\n", d.Cfg.DBName)
	sec := map[string]any{
		"admins":  map[string]any{"names": []string{}, "roles": []string{"_admin"}},
		"members": map[string]any{"names": []string{}, "roles": []string{"_admin"}},
	}
	if err := ensureSecurity(ctx, d.Couch, d.Cfg.DBName, sec); err != nil {
		return err
	}
	fmt.Fprintln(out, "security: admins only")
	if err := ensureDesignDoc(ctx, d.Couch, d.Cfg.DBName); err != nil {
		return err
	}
	fmt.Fprintf(out, "%s: validate_doc_update installed\n", designDocID)
	info, err := d.Couch.Server(ctx)
	if err != nil {
		return fmt.Errorf("read server info: %w", err)
	}
	if info.CouchDB && info.Major >= 2 {
		if err := ensureDB(ctx, d.Couch, "_global_changes"); err != nil {
			return err
		}
		fmt.Fprintln(out, "_global_changes: present")
	}
	wait := cmp.Or(d.Cfg.AdminTimeout, defaultAdminTimeout)
	var report topologyReport
	var steps bytes.Buffer // of the last attempt
	err = ensureTopology(ctx, func(ctx context.Context) (err error) {
		steps.Reset()
		report, err = installObjects(ctx, d.JS, installTopology(d), update, &steps)
		return err
	}, wait, placementRetry)
	_, _ = out.Write(steps.Bytes())
	if err != nil {
		return err
	}
	if report.kept > 0 {
		fmt.Fprintf(out, "%d setting(s) differ from install's and were kept", report.kept)
		if !update {
			fmt.Fprint(out, "; `producer install --update` applies those JetStream can change in place")
		}
		fmt.Fprintln(out)
	}
	if report.updated > 0 {
		fmt.Fprintf(out, "%d setting(s) updated\n", report.updated)
	}
	fmt.Fprintln(out, "install complete")
	return nil
}

// placementRetry is the pause between two attempts of installObjects that JetStream refused for
// now (ensureTopology).
const placementRetry = 2 * time.Second

// JetStream's answers that mean "not now" rather than "no": a cluster formed moments ago cannot
// place a replicated stream until its peers are current ("no suitable peers for placement, peer
// offline"), and has no meta leader for a while ("JetStream system temporarily unavailable").
const (
	errCodeNoPeers            = 10005
	errCodeTemporarilyBlocked = 10008
)

// ensureTopology runs ensure (installObjects), again every pause for up to wait while JetStream
// answers that it cannot do it yet (errCodeNoPeers, errCodeTemporarilyBlocked). Any other error,
// or the last one once wait is over, is returned.
func ensureTopology(ctx context.Context, ensure func(context.Context) error, wait, pause time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		err := ensure(ctx)
		var apiErr *jetstream.APIError
		if err == nil || !errors.As(err, &apiErr) ||
			apiErr.ErrorCode != errCodeNoPeers && apiErr.ErrorCode != errCodeTemporarilyBlocked ||
			time.Now().Add(pause).After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pause):
		}
	}
}

// installTopology is the topology install creates: d's, with the retention of the changes and
// the dead letters and the bound on unacknowledged jobs that d's configuration sets.
func installTopology(d *producer.Conns) natsjs.Topology {
	t := d.Topo
	t.ChangesMaxAge, t.DeadLetterMaxAge, t.MaxAckPending = d.Cfg.ChangesMaxAge, d.Cfg.DeadLetterMaxAge, d.Cfg.MaxAckPending
	return t
}

// topologyReport counts what installObjects found.
type topologyReport struct {
	kept    int // differences left as they are
	updated int // differences applied (update)
}

// installObjects creates every stream, bucket and consumer of t that is missing, and prints one
// line per object to out: created, or present followed by one line per setting that differs
// from what install would create. Those differences are kept, unless update: then the ones
// JetStream can change in place are applied (the object's other settings stay as they are) and
// printed as changed. What JetStream cannot change in place is reported and always kept.
func installObjects(ctx context.Context, js jetstream.JetStream, t natsjs.Topology, update bool, out io.Writer) (topologyReport, error) {
	var r topologyReport
	for _, o := range t.Objects() {
		created, err := o.Create(ctx, js)
		if err != nil {
			return r, err
		}
		if created {
			fmt.Fprintf(out, "%s: created\n", o)
			continue
		}
		fmt.Fprintf(out, "%s: present\n", o)
		diffs, apply, err := compare(ctx, js, o)
		if err != nil {
			return r, err
		}
		if update && changeable(diffs) {
			if err := apply(ctx); err != nil {
				return r, fmt.Errorf("update %s: %w", o, err)
			}
		}
		for _, d := range diffs {
			switch {
			case d.fixed:
				r.kept++
				fmt.Fprintf(out, "%s: %s is %s, default %s (kept: JetStream cannot change it in place)\n", o, d.setting, d.have, d.want)
			case update:
				r.updated++
				fmt.Fprintf(out, "%s: %s was %s, now %s (updated)\n", o, d.setting, d.have, d.want)
			default:
				r.kept++
				fmt.Fprintf(out, "%s: %s is %s, default %s (kept; --update applies it)\n", o, d.setting, d.have, d.want)
			}
		}
	}
	return r, nil
}

// compare reads the existing o and returns how it differs from o's configuration, and a
// function that applies the differences JetStream can change in place.
func compare(ctx context.Context, js jetstream.JetStream, o natsjs.Object) ([]difference, func(context.Context) error, error) {
	if o.Kind == natsjs.KindConsumer {
		c, err := js.Consumer(ctx, o.ConsumerStream, o.Consumer.Durable)
		if err != nil {
			return nil, nil, fmt.Errorf("read %s: %w", o, err)
		}
		have := c.CachedInfo().Config
		diffs := diff(consumerSettings, have, o.Consumer)
		return diffs, func(ctx context.Context) error {
			_, err := js.UpdateConsumer(ctx, o.ConsumerStream, applyChangeable(consumerSettings, have, o.Consumer, diffs))
			return err
		}, nil
	}
	settings, want := streamSettings, o.Stream
	if o.Kind == natsjs.KindBucket {
		settings, want = bucketSettings, bucketStream(o.Bucket)
	}
	st, err := js.Stream(ctx, o.StreamName())
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", o, err)
	}
	have := st.CachedInfo().Config
	diffs := diff(settings, have, want)
	return diffs, func(ctx context.Context) error {
		_, err := js.UpdateStream(ctx, applyChangeable(settings, have, want, diffs))
		return err
	}, nil
}

// ensureDB creates db unless it exists.
func ensureDB(ctx context.Context, c *couch.Client, db string) error {
	if _, err := c.DBInfo(ctx, db); err == nil {
		return nil
	} else if !errors.Is(err, couch.ErrNotFound) {
		return fmt.Errorf("look up db %s: %w", db, err)
	}
	err := c.Do(ctx, http.MethodPut, c.DBPath(db), nil, nil, nil)
	var herr *couch.HTTPError
	if err != nil && !(errors.As(err, &herr) && herr.Status == http.StatusPreconditionFailed) {
		return fmt.Errorf("create db %s: %w", db, err)
	}
	return nil
}

// ensureSecurity sets the db's security object unless it already says the same; a concurrent
// install's conflicting write is retried.
func ensureSecurity(ctx context.Context, c *couch.Client, db string, sec map[string]any) error {
	path := c.DBPath(db) + "/_security"
	want, _ := json.Marshal(sec)
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		var cur map[string]any
		if gerr := c.Do(ctx, http.MethodGet, path, nil, nil, &cur); gerr == nil {
			delete(cur, "_id")
			delete(cur, "_rev")
			if got, _ := json.Marshal(cur); string(got) == string(want) {
				return nil
			}
		}
		err = c.Do(ctx, http.MethodPut, path, nil, sec, nil)
		var herr *couch.HTTPError
		if err == nil || !(errors.As(err, &herr) && herr.Status == http.StatusConflict) {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("set security of %s: %w", db, err)
	}
	return nil
}

// ensureDesignDoc writes the validation design doc unless the current one is identical.
func ensureDesignDoc(ctx context.Context, c *couch.Client, db string) error {
	path := c.DBPath(db) + "/" + designDocID
	for attempt := 0; attempt < 5; attempt++ {
		var cur struct {
			Rev      string `json:"_rev"`
			Validate string `json:"validate_doc_update"`
		}
		err := c.Do(ctx, http.MethodGet, path, nil, nil, &cur)
		if err != nil && !errors.Is(err, couch.ErrNotFound) {
			return fmt.Errorf("read %s: %w", designDocID, err)
		}
		if cur.Validate == validateDocUpdate {
			return nil
		}
		doc := map[string]any{"language": "javascript", "validate_doc_update": validateDocUpdate}
		if cur.Rev != "" {
			doc["_rev"] = cur.Rev
		}
		err = c.Do(ctx, http.MethodPut, path, nil, doc, nil)
		var herr *couch.HTTPError
		if err == nil {
			return nil
		}
		if !(errors.As(err, &herr) && herr.Status == http.StatusConflict) {
			return fmt.Errorf("write %s: %w", designDocID, err)
		}
	}
	return fmt.Errorf("write %s: conflicts persisted", designDocID)
}

// Uninstall removes the on_change checkpoints, the streams and consumers of d's installation and,
// unless keepDB, the spiegel db, printing each step to out.
func Uninstall(ctx context.Context, d *producer.Conns, log *logrus.Logger, keepDB bool, out io.Writer) error {
	n, err := removeCheckpoints(ctx, d, log)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "on_change checkpoints (_local docs in the watched dbs): %d removed\n", n)
	// Every installation on the server shares a db's identity: deleting it would make the others
	// start their rules over in the db.
	fmt.Fprintf(out, "db identities (_local/%s in the watched dbs): kept, shared with any other installation on this server\n", checkpoint.IdentityID)
	if err := natsjs.Remove(ctx, d.JS, d.Topo); err != nil {
		return err
	}
	fmt.Fprintln(out, "streams and consumers: removed")
	if !keepDB {
		err := d.Couch.Do(ctx, http.MethodDelete, d.Couch.DBPath(d.Cfg.DBName), nil, nil, nil)
		if err != nil && !errors.Is(err, couch.ErrNotFound) {
			return fmt.Errorf("delete db %s: %w", d.Cfg.DBName, err)
		}
		fmt.Fprintf(out, "spiegel db %q: removed\n", d.Cfg.DBName)
	}
	return nil
}

// removeCheckpoints deletes the _local checkpoint docs of every on_change rule in every db it
// matches, and returns how many it deleted. Without the spiegel db there are no rules, and so
// nothing to find.
func removeCheckpoints(ctx context.Context, d *producer.Conns, log *logrus.Logger) (int, error) {
	set := rules.NewSet()
	rf := &rulefeed.Follower{Couch: d.Couch, DB: d.Cfg.DBName, Set: set, Log: log.WithField("component", "rules")}
	if _, err := rf.Load(ctx); err != nil {
		if errors.Is(err, couch.ErrNotFound) || strings.Contains(err.Error(), "does not exist") {
			return 0, nil
		}
		return 0, err
	}
	store := checkpoint.NewOnChangeStore(d.Couch, nil)
	n := 0
	err := d.Couch.EachDB(ctx, func(db string) error {
		if db == d.Cfg.DBName || producer.IsSystemDB(db) {
			return nil
		}
		for _, r := range set.All() {
			if r.Kind() != rules.KindOnChange || !r.MatchesDB(db) {
				continue
			}
			found, err := store.DeleteIfAny(ctx, r.ID(), db)
			if err != nil {
				return err
			}
			if found {
				n++
			}
		}
		return nil
	})
	return n, err
}
