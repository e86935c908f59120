// Command follow is the consumer's guide's runnable example (consumers/onchange/README.md, "Reading change streams"):
// a service that reads the changes a `subject` rule publishes for one db, as it would to
// rebuild its state from them. It prints one line per change and keeps the latest revision of
// every doc in memory; it never reads CouchDB.
//
//	follow -db userdb-alice                       # from the start of the stream, then live
//	follow -db userdb-alice -since-seq 1042       # from stream sequence 1042
//	follow -db userdb-alice -since-time 2h        # from two hours ago (or an RFC 3339 time)
//	follow -db userdb-alice -durable alice-index  # a durable consumer: resumes where it stopped
//
// Without -durable it reads through an ordered consumer: no state on the server, in stream order,
// recreated by the client after a NATS failure. With -durable it reads through a durable pull
// consumer and acknowledges each change once handled: a restart resumes after the last one.
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
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Change is one message of a change stream: the db's `_changes` row, with its db.
type Change struct {
	DB      string `json:"db"`
	Seq     string `json:"seq"` // opaque: compare for equality only
	ID      string `json:"id"`
	Changes []struct {
		Rev string `json:"rev"`
	} `json:"changes"`
	Deleted bool            `json:"deleted,omitempty"`
	Doc     json.RawMessage `json:"doc,omitempty"`

	// From the message: the stream sequence, the time it was stored, and the replay it belongs
	// to ("" for a first publication; see consumers/onchange/README.md, "Change streams").
	StreamSeq uint64    `json:"-"`
	Stored    time.Time `json:"-"`
	Replay    string    `json:"-"`
}

// Rev is the change's revision: the doc's current (winning) revision when it was read.
func (c Change) Rev() string {
	if len(c.Changes) == 0 {
		return ""
	}
	return c.Changes[0].Rev
}

// Options say what to follow and from where.
type Options struct {
	Stream  string    // the stream capturing the rule's subject (SPIEGEL_CHANGES by default)
	Subject string    // the rule's subject for the db, e.g. spiegel.changes.<db token>
	FromSeq uint64    // start at this stream sequence (0: not set)
	From    time.Time // start at this time (zero: not set); neither: from the start
	Durable string    // a durable consumer of this name instead of an ordered one
	// AckWait of the durable consumer (0: the server's default, 30s): a change delivered to a
	// service that stopped before handling it is delivered again after it.
	AckWait time.Duration
}

// SubjectFor is the subject the default `subject` (spiegel.changes.${db_name}) gives db:
// ${db_name} becomes the db's subject token, a reversible encoding of any db name.
func SubjectFor(prefix, db string) string { return prefix + ".changes." + events.EncodeDBName(db) }

// Follow reads opt.Subject's changes from where opt says, in stream order, and calls handle for
// each until ctx ends (nil) or handle or NATS fails. With a durable consumer a change is
// acknowledged once handle returns nil; an error from handle stops Follow, and the change is
// delivered again to the next Follow.
func Follow(ctx context.Context, js jetstream.JetStream, opt Options, handle func(Change) error) error {
	deliver, startSeq, startTime := jetstream.DeliverAllPolicy, uint64(0), (*time.Time)(nil)
	switch {
	case opt.FromSeq > 0:
		deliver, startSeq = jetstream.DeliverByStartSequencePolicy, opt.FromSeq
	case !opt.From.IsZero():
		deliver, startTime = jetstream.DeliverByStartTimePolicy, &opt.From
	}
	var cons jetstream.Consumer
	var err error
	if opt.Durable == "" {
		cons, err = js.OrderedConsumer(ctx, opt.Stream, jetstream.OrderedConsumerConfig{
			FilterSubjects: []string{opt.Subject}, DeliverPolicy: deliver, OptStartSeq: startSeq, OptStartTime: startTime,
		})
	} else {
		cons, err = js.CreateOrUpdateConsumer(ctx, opt.Stream, jetstream.ConsumerConfig{
			Durable: opt.Durable, FilterSubject: opt.Subject, AckPolicy: jetstream.AckExplicitPolicy,
			DeliverPolicy: deliver, OptStartSeq: startSeq, OptStartTime: startTime, MaxAckPending: 1, AckWait: opt.AckWait,
		})
	}
	if err != nil {
		return fmt.Errorf("consume %s on stream %s: %w", opt.Subject, opt.Stream, err)
	}
	next, stop, err := reader(ctx, cons, opt.Durable != "")
	if err != nil {
		return fmt.Errorf("consume %s on stream %s: %w", opt.Subject, opt.Stream, err)
	}
	defer stop()
	for {
		m, err := next()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return nil
			}
			return fmt.Errorf("read %s: %w", opt.Subject, err)
		}
		if ctx.Err() != nil {
			// Stopped: the reader may still hand out what it holds. Left unacknowledged, a
			// durable consumer's message comes again.
			return nil
		}
		var c Change
		if err := json.Unmarshal(m.Data(), &c); err != nil {
			return fmt.Errorf("message on %s is not a change: %w", m.Subject(), err)
		}
		if meta, err := m.Metadata(); err == nil {
			c.StreamSeq, c.Stored = meta.Sequence.Stream, meta.Timestamp
		}
		c.Replay = m.Headers().Get("Spiegel-Replay")
		if err := handle(c); err != nil {
			return err
		}
		if opt.Durable != "" {
			// Acknowledge a handled change even when ctx ended meanwhile.
			actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			err := m.DoubleAck(actx)
			cancel()
			if err != nil {
				return fmt.Errorf("acknowledge change %d: %w", c.StreamSeq, err)
			}
		}
	}
}

// fetchWait bounds each one-message request of a durable reader; a request left on the server
// by a stopped reader lives at most this long.
const fetchWait = 5 * time.Second

// reader returns the next message of cons until ctx ends, and a stop func. An ordered consumer
// reads through a Messages iterator; a durable one asks for one message at a time, so no
// acknowledged-later change waits in the client when the service stops. Each of those is its own
// request (Next) rather than an iterator capped at one message, whose next request can be skipped
// when a message comes back before the previous request's send finished, leaving the reader idle
// until the iterator's heartbeat check (30 s).
func reader(ctx context.Context, cons jetstream.Consumer, durable bool) (next func() (jetstream.Msg, error), stop func(), err error) {
	if durable {
		return func() (jetstream.Msg, error) {
			for {
				fctx, cancel := context.WithTimeout(ctx, fetchWait)
				m, err := cons.Next(jetstream.FetchContext(fctx))
				cancel()
				if m != nil || ctx.Err() != nil {
					return m, err
				}
				if err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
					return nil, err
				}
			}
		}, func() {}, nil
	}
	msgs, err := cons.Messages()
	if err != nil {
		return nil, nil, err
	}
	after := context.AfterFunc(ctx, msgs.Stop)
	return func() (jetstream.Msg, error) { return msgs.Next() }, func() { after(); msgs.Stop() }, nil
}

// State is the latest revision of every doc, rebuilt from a change stream.
type State map[string]Change

// Apply records c unless the state already holds that doc at that revision (a replay, or a
// first publication seen again, brings nothing new); a deletion keeps the tombstone.
func (s State) Apply(c Change) (changed bool) {
	if old, ok := s[c.ID]; ok && old.Rev() == c.Rev() {
		return false
	}
	s[c.ID] = c
	return true
}

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "follow:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("follow", flag.ContinueOnError)
	url := fs.String("nats", nats.DefaultURL, "NATS server URL(s)")
	db := fs.String("db", "", "the db whose changes to follow (required)")
	prefix := fs.String("prefix", "spiegel", "SPIEGEL_SUBJECT_PREFIX of the installation")
	stream := fs.String("stream", "SPIEGEL_CHANGES", "the stream capturing the rule's subject")
	subject := fs.String("subject", "", "the rule's subject for the db (default: <prefix>.changes.<db token>)")
	fromSeq := fs.Uint64("since-seq", 0, "start at this stream sequence")
	since := fs.String("since-time", "", "start at this time: RFC 3339, or a duration ago (2h)")
	durable := fs.String("durable", "", "read through a durable consumer of this name (resumes where it stopped)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *db == "" && *subject == "" {
		return errors.New("-db is required")
	}
	opt := Options{Stream: *stream, Subject: *subject, FromSeq: *fromSeq, Durable: *durable}
	if opt.Subject == "" {
		opt.Subject = SubjectFor(*prefix, *db)
	}
	if *since != "" {
		if d, err := time.ParseDuration(*since); err == nil {
			opt.From = time.Now().Add(-d)
		} else if t, err := time.Parse(time.RFC3339, *since); err == nil {
			opt.From = t
		} else {
			return fmt.Errorf("-since-time %q: want an RFC 3339 time or a duration", *since)
		}
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	nc, err := nats.Connect(*url, nats.Name("spiegel-follow-example"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	state := State{}
	return Follow(ctx, js, opt, func(c Change) error {
		what := "updated"
		if c.Deleted {
			what = "deleted"
		}
		if !state.Apply(c) {
			what = "seen again"
		}
		_, err := fmt.Fprintf(out, "#%d %s %s %s %s replay=%q docs=%d\n", c.StreamSeq, c.DB, c.ID, c.Rev(), what, c.Replay, len(state))
		return err
	})
}
