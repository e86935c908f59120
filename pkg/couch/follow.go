package couch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// DefaultHeartbeat is the heartbeat asked of continuous feeds when none is configured. A
// stream silent for twice the heartbeat is torn down and reopened.
const DefaultHeartbeat = 10 * time.Second

// SinceNow as a since value starts a feed at the server's current position.
const SinceNow = "now"

// feedLineError is a line in which the server reports an error instead of a row (e.g.
// {"error":"timeout"}): it ends the connection, which is reopened.
type feedLineError struct{ name, reason string }

func (e *feedLineError) Error() string {
	return logging.RedactText(fmt.Sprintf("feed reported error %s: %s", e.name, e.reason))
}

// lineDecoder decodes one non-blank feed line (or one row of a normal feed's results). ok says
// whether it holds an item to emit; seq, when not empty, is the position after the line. err is
// a *feedLineError for a server-reported error and anything else for a malformed line.
type lineDecoder[T any] func(line []byte) (item T, seq string, ok bool, err error)

// follower runs a continuous feed forever: reconnecting with capped, jittered backoff,
// resuming from the last position seen, and tearing down streams that stall.
type follower[T any] struct {
	c         *Client
	log       logrus.FieldLogger
	name      string // for errors and logs, e.g. "_db_updates"
	path      string // request path, for errors
	heartbeat time.Duration
	// request builds the request of one connection: feed is "continuous" or "normal".
	request   func(ctx context.Context, feed, since string) (*http.Request, error)
	decode    lineDecoder[T]
	malformed atomic.Int64
	// onState, when set, hears nil for every established connection and each failure.
	onState func(err error)
}

func (f *follower[T]) state(err error) {
	if f.onState != nil {
		f.onState(err)
	}
}

// connState records what one connection achieved.
type connState struct {
	gotBytes bool // anything at all, heartbeats included
	gotLine  bool // a decoded row or a last_seq line
}

// run follows the feed from since ("" = the beginning, "now" = only new rows) and calls emit for
// each row in feed order, one at a time. It returns ctx.Err() when ctx ends, emit's error
// unchanged, or a permanent error (400/401/403). emit sees every row at least once: after a
// reconnect the feed resumes from the seq of the last row emitted (or a later last_seq).
func (f *follower[T]) run(ctx context.Context, since string, emit func(T) error) error {
	attempt := 0
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if since == SinceNow {
			err := f.resolveNow(ctx, &since, emit)
			if httpStatus(err) == http.StatusBadRequest {
				err = redact(fmt.Errorf("normal feed with since=now refused: %w", err)) // not fatal: fall back
			} else if done, rerr := f.terminal(ctx, err); done {
				if ctx.Err() == nil && !isEmitError(err) {
					f.state(rerr) // a refused feed is reported whichever request met the refusal
				}
				return rerr
			}
			if err != nil {
				f.log.WithError(err).Debug("cannot resolve since=now with a normal feed: following from now")
			}
		}
		var st connState
		err := f.once(ctx, &since, &st, emit)
		if done, rerr := f.terminal(ctx, err); done {
			if ctx.Err() == nil && !isEmitError(err) {
				f.state(rerr)
			}
			return rerr
		}
		if err == nil && st.gotLine {
			f.log.WithField("seq", since).Debug("feed ended: reconnecting")
			attempt = 0
			continue
		}
		if err == nil {
			err = errors.New("feed ended without data")
		}
		f.state(err)
		if st.gotBytes {
			attempt = 0
		}
		attempt++
		delay := f.c.retry.Delay(attempt)
		f.log.WithError(err).WithFields(logrus.Fields{"seq": since, "attempt": attempt, "delay": delay.String()}).
			Warnf("%s: reconnecting", f.name)
		if err := backoff.Sleep(ctx, delay); err != nil {
			return err
		}
	}
}

// isEmitError reports whether err is emit's own error (not the feed's).
func isEmitError(err error) bool {
	var ee *emitError
	return errors.As(err, &ee)
}

// terminal reports whether err ends run, and with which error.
func (f *follower[T]) terminal(ctx context.Context, err error) (bool, error) {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return true, ctxErr
	}
	if err == nil {
		return false, nil
	}
	var ee *emitError
	if errors.As(err, &ee) {
		return true, ee.err
	}
	if IsPermanent(err) {
		return true, fmt.Errorf("follow %s: %w", f.name, err)
	}
	return false, nil
}

// once reads one connection until it ends, updating *since after every line.
func (f *follower[T]) once(ctx context.Context, since *string, st *connState, emit func(T) error) error {
	from := *since
	hb := f.heartbeat
	if hb <= 0 {
		hb = DefaultHeartbeat
	}
	s, err := f.c.openStream(ctx, 2*hb, f.path, func(ctx context.Context) (*http.Request, error) {
		return f.request(ctx, "continuous", from)
	})
	if err != nil {
		return err
	}
	defer s.stop()
	f.state(nil)
	err = readLines(s, maxLineBytes, func(line []byte) error {
		st.gotBytes = true
		return f.handle(line, since, st, emit)
	}, func() { f.skip(nil, errLineTooLong) })
	if s.received.Load() {
		st.gotBytes = true
	}
	if err != nil {
		var ee *emitError
		var fe *feedLineError
		if errors.As(err, &ee) || errors.As(err, &fe) || errors.Is(err, errStalled) {
			return err
		}
		return redact(fmt.Errorf("read %s: %w", f.name, err))
	}
	return nil
}

func (f *follower[T]) handle(line []byte, since *string, st *connState, emit func(T) error) error {
	item, seq, ok, err := f.decode(line)
	if err != nil {
		var fe *feedLineError
		if errors.As(err, &fe) {
			return err
		}
		f.skip(line, err)
		return nil
	}
	st.gotLine = true
	if ok {
		if err := emit(item); err != nil {
			return &emitError{err: err}
		}
	}
	if seq != "" {
		*since = seq
	}
	return nil
}

// skip logs and counts a malformed line; the feed goes on.
func (f *follower[T]) skip(line []byte, err error) {
	n := f.malformed.Add(1)
	f.c.malformed.Add(1)
	f.log.WithError(redact(err)).WithFields(logrus.Fields{
		"line":      logging.RedactText(truncate(line, 200)),
		"malformed": n,
	}).Warnf("%s: skipping malformed line", f.name)
}

// resolveNow turns since=now into a real position with one normal-feed request, so that a later
// reconnect resumes from it rather than from a new "now" (which would lose what happened in
// between). Rows already in that answer are emitted.
func (f *follower[T]) resolveNow(ctx context.Context, since *string, emit func(T) error) error {
	ctx, cancel := context.WithTimeout(ctx, f.c.timeout)
	defer cancel()
	req, err := f.request(ctx, "normal", SinceNow)
	if err != nil {
		return err
	}
	resp, err := f.c.Send(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var body struct {
		Results []json.RawMessage `json:"results"`
		LastSeq *Seq              `json:"last_seq"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return redact(fmt.Errorf("decode %s: %w", f.name, err))
	}
	if body.LastSeq == nil || *body.LastSeq == "" {
		return fmt.Errorf("%s: normal feed has no last_seq", f.name)
	}
	var st connState
	next := SinceNow
	for _, row := range body.Results {
		if err := f.handle(row, &next, &st, emit); err != nil {
			return err
		}
	}
	*since = string(*body.LastSeq)
	return nil
}
