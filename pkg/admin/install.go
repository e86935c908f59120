package admin

import (
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

// Install creates or updates everything Spiegel needs on d's servers, printing each step to out.
// Every step tolerates "already there", so it is idempotent and safe to run from several
// processes at once.
func Install(ctx context.Context, d *producer.Conns, out io.Writer) error {
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
	if err := ensureTopology(ctx, func(ctx context.Context) error { return natsjs.Ensure(ctx, d.JS, d.Topo) }, wait, placementRetry); err != nil {
		return err
	}
	fmt.Fprintf(out, "streams %s, %s, %s and consumers replicator, onchange: present\n",
		d.Topo.Subjects.WorkStream(), d.Topo.Subjects.DeadLetterStream(), d.Topo.Subjects.ChangesStream())
	fmt.Fprintln(out, "install complete")
	return nil
}

// placementRetry is the pause between two attempts of natsjs.Ensure that JetStream refused for
// now (ensureTopology).
const placementRetry = 2 * time.Second

// JetStream's answers that mean "not now" rather than "no": a cluster formed moments ago cannot
// place a replicated stream until its peers are current ("no suitable peers for placement, peer
// offline"), and has no meta leader for a while ("JetStream system temporarily unavailable").
const (
	errCodeNoPeers            = 10005
	errCodeTemporarilyBlocked = 10008
)

// ensureTopology runs ensure (natsjs.Ensure), again every pause for up to wait while JetStream
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
