// Command mirror is the runnable example of consumers/onchange/README.md, "Doc-state mirror": a service that
// rebuilds the current state of every doc from the NATS KV bucket a `mirror` rule keeps, then
// follows it live; it never reads CouchDB.
//
//	mirror -bucket ORDERS_STATE               # every db of the bucket
//	mirror -bucket ORDERS_STATE -db orders_eu # one db
//
// It prints one line once the state is rebuilt ("ready") and one per live update.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
)

// Doc is one doc of the state: its db, id and winning revision's body ({"_id", "_rev", ...};
// {"_id", "_rev", "too_large": true, "size"} for a doc larger than the bucket's values).
type Doc struct {
	DB, ID string
	Body   json.RawMessage
}

// Key is a doc's place in a State.
type Key struct{ DB, ID string }

// State is the winning revision of every doc of the mirror.
type State map[Key]json.RawMessage

// Rebuild watches bucket (only db's keys when db is not ""): it fills state with every current
// value, calls ready once they are all in, then applies live updates (a deleted doc leaves the
// state) and calls update after each, until ctx ends (nil) or NATS fails.
func Rebuild(ctx context.Context, js jetstream.JetStream, bucket, db string, state State, ready func(), update func(k Key, deleted bool)) error {
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return fmt.Errorf("mirror bucket %s: %w", bucket, err)
	}
	var w jetstream.KeyWatcher
	if db == "" {
		w, err = kv.WatchAll(ctx)
	} else {
		w, err = kv.Watch(ctx, mirrorkey.DBPrefix(db))
	}
	if err != nil {
		return fmt.Errorf("watch %s: %w", bucket, err)
	}
	defer func() { _ = w.Stop() }()
	live := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-w.Updates():
			if !ok {
				if ctx.Err() != nil {
					return nil // the watch ends with ctx: it may close its channel before ctx.Done is chosen
				}
				return errors.New("watch ended")
			}
			if e == nil { // every current value delivered
				live = true
				if ready != nil {
					ready()
				}
				continue
			}
			d, id, err := mirrorkey.Decode(e.Key())
			if err != nil {
				continue // not a mirror key
			}
			k := Key{d, id}
			deleted := e.Operation() != jetstream.KeyValuePut
			if deleted {
				delete(state, k)
			} else {
				state[k] = e.Value()
			}
			if live && update != nil {
				update(k, deleted)
			}
		}
	}
}

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "mirror:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("mirror", flag.ContinueOnError)
	url := fs.String("nats", nats.DefaultURL, "NATS server URL(s)")
	bucket := fs.String("bucket", "", "the mirror rule's bucket (required)")
	db := fs.String("db", "", "only this db's docs")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *bucket == "" {
		return errors.New("-bucket is required")
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	nc, err := nats.Connect(*url, nats.Name("spiegel-mirror-example"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	state := State{}
	return Rebuild(ctx, js, *bucket, *db, state,
		func() { fmt.Fprintf(out, "ready docs=%d\n", len(state)) },
		func(k Key, deleted bool) {
			what := "updated"
			if deleted {
				what = "deleted"
			}
			fmt.Fprintf(out, "%s %s %s docs=%d\n", k.DB, k.ID, what, len(state))
		})
}
