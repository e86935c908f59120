package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// streamMsg is one message of the change stream, as the oracle needs it.
type streamMsg struct {
	Seq    uint64 // stream sequence: the stored order
	MsgID  string // Nats-Msg-Id
	DB     string
	ID     string
	Rev    string
	Feed   string    // the change's seq in its db's feed
	Stored time.Time // when the stream stored it
}

// streamReader reads a stream into memory, incrementally: each catchUp reads the messages
// stored since the last one, with a fresh ordered consumer starting after the last message
// read (a NATS node killed meanwhile costs a retry at the next call, nothing else). When what it
// read is no longer what the stream holds — the stream went back (NATS lost messages it had
// acknowledged, and gave their sequences to later ones), the message at the last sequence read
// is another, or messages were removed (a rule's heal) — it reads the stream again from its
// start: the verdict judges what the stream holds, as a service reading it now would see it.
type streamReader struct {
	js     jetstream.JetStream
	stream string

	// apiTimeout bounds each JetStream request of a catch-up (0: defaultAPITimeout).
	apiTimeout time.Duration

	mu      sync.Mutex
	last    uint64 // stream sequence of the last message read
	deleted int    // the stream's gaps (messages removed between its first and last) then
	msgs    []streamMsg
	rereads int // times the stream was read again from its start
}

// changed reports whether the stream no longer holds what was read from it (see streamReader).
// A read of the last message read that fails (no answer during a leader election) is an error,
// not a change: the next catch-up looks again, rather than reading the stream from its start and
// counting a reread that the report puts down to a loss.
func (s *streamReader) changed(ctx context.Context, st jetstream.Stream, state jetstream.StreamState) (bool, error) {
	if s.last == 0 || len(s.msgs) == 0 {
		return false, nil
	}
	if state.LastSeq < s.last || state.NumDeleted != s.deleted {
		return true, nil
	}
	m, err := st.GetMsg(ctx, s.last)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("read message %d of %s: %w", s.last, s.stream, err)
	}
	return !m.Time.Equal(s.msgs[len(s.msgs)-1].Stored), nil
}

// defaultAPITimeout bounds each JetStream request of a catch-up. A request sent while the cluster
// elects a leader can go unanswered: the reader's lock is held while it waits, and the
// convergence check waits for that lock. With one timeout of 60 s for the whole catch-up, such a
// consumer create, sent by the probe watcher during the NATS faults, held the check for 38 of
// the short run's 60 s, and a check that began before the deadline ended after it with what it
// had read of the dbs at its start.
const defaultAPITimeout = 10 * time.Second

// catchUp reads every message stored up to the stream's last sequence at the time of the call.
// It returns the number of messages read so far; an error leaves what was read in place (a
// request that timed out is tried again at the next call).
func (s *streamReader) catchUp(ctx context.Context) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	timeout := s.apiTimeout
	if timeout <= 0 {
		timeout = defaultAPITimeout
	}
	call := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, timeout) }
	cctx, cancel := call()
	defer cancel()
	st, err := s.js.Stream(cctx, s.stream)
	if err != nil {
		return len(s.msgs), err
	}
	cctx, cancel = call()
	defer cancel()
	info, err := st.Info(cctx)
	if err != nil {
		return len(s.msgs), err
	}
	cctx, cancel = call()
	defer cancel()
	changed, err := s.changed(cctx, st, info.State)
	if err != nil {
		return len(s.msgs), err
	}
	if changed {
		s.last, s.msgs = 0, nil
		s.rereads++
	}
	s.deleted = info.State.NumDeleted
	target := info.State.LastSeq
	if target <= s.last {
		return len(s.msgs), nil
	}
	cctx, cancel = call()
	defer cancel()
	cons, err := s.js.OrderedConsumer(cctx, s.stream, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: s.last + 1})
	if err != nil {
		return len(s.msgs), err
	}
	for s.last < target {
		// No more than the stream holds up to target: a full batch ends the pull at once, where
		// a larger one waits out FetchMaxWait for messages that are not there. (Removed
		// messages leave gaps; then the wait ends it.)
		batch, err := cons.Fetch(int(min(target-s.last, 1000)), jetstream.FetchMaxWait(min(timeout, 5*time.Second)))
		if err != nil {
			return len(s.msgs), err
		}
		n := 0
		for m := range batch.Messages() {
			n++
			meta, err := m.Metadata()
			if err != nil {
				return len(s.msgs), err
			}
			s.last = meta.Sequence.Stream
			var c struct {
				DB      string `json:"db"`
				Seq     string `json:"seq"`
				ID      string `json:"id"`
				Changes []struct {
					Rev string `json:"rev"`
				} `json:"changes"`
			}
			if err := json.Unmarshal(m.Data(), &c); err != nil || len(c.Changes) == 0 {
				return len(s.msgs), fmt.Errorf("message %d of %s is not a change: %q", s.last, s.stream, m.Data())
			}
			s.msgs = append(s.msgs, streamMsg{Seq: s.last, MsgID: m.Headers().Get(jetstream.MsgIDHeader),
				DB: c.DB, ID: c.ID, Rev: c.Changes[0].Rev, Feed: c.Seq, Stored: meta.Timestamp})
		}
		if err := batch.Error(); err != nil {
			return len(s.msgs), err
		}
		if n == 0 {
			return len(s.msgs), fmt.Errorf("no message of %s after %d although it holds up to %d", s.stream, s.last, target)
		}
	}
	return len(s.msgs), nil
}

// rereadCount is how many times the stream was read again from its start.
func (s *streamReader) rereadCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rereads
}

// all returns the messages read so far, in stream order.
func (s *streamReader) all() []streamMsg {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]streamMsg(nil), s.msgs...)
}

// feedOrder is the test-only oracle of a seq's position in its db's feed: the number before the
// first '-' of a CouchDB 2+/3 seq (the sum of the shard positions it covers; with one shard, q=1,
// it grows by one per row) or PouchDB Server's integer seq. The product never parses seqs.
func feedOrder(seq string) (int64, bool) {
	head, _, _ := strings.Cut(strings.Trim(seq, `"`), "-")
	n, err := strconv.ParseInt(head, 10, 64)
	return n, err == nil
}

// incarnation returns the incarnation a doc id carries ("i3_d0007" → 3), or -1.
func incarnation(id string) int {
	head, _, ok := strings.Cut(id, "_")
	if !ok || !strings.HasPrefix(head, "i") {
		return -1
	}
	n, err := strconv.Atoi(head[1:])
	if err != nil {
		return -1
	}
	return n
}
