package natsjs

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// LastMsg is the latest message of a subject (see LastPerSubject).
type LastMsg struct {
	Seq    uint64
	Header nats.Header
	Data   []byte // nil when read with headers only
}

// KVDeleted reports whether a message of a key-value bucket's stream with header h says its key
// holds no value: a delete or purge, or a marker the server left (a key removed by its TTL).
func KVDeleted(h nats.Header) bool {
	op := h.Get("KV-Operation")
	return op == "DEL" || op == "PURGE" || h.Get(jetstream.MarkerReasonHeader) != ""
}

// LastPerSubject reads the latest message of every subject of stream s that filter matches (a
// subject filter; "" for every subject of the stream), keyed by subject, without its data when
// headersOnly.
//
// It does what a KV key listing or watch does, with one ephemeral consumer, but knows when it is
// done from the stream's subject index. nats.go's KV listing and watch instead end their current
// values at the first message whose pending count is 0, which a clustered JetStream can report
// before the last one (seen in our chaos runs; nats.py #995 shows the same on 2.14), and a listing
// ends quietly when its subscription is closed.
//
//   - With a filter it names the subjects first and reads until it has a message of each: a
//     subject rewritten while it reads is waited for, and a filter that matches nothing costs
//     one request and no consumer.
//   - With "" it counts them (naming every subject of a big stream would cost a list of them
//     all) and reads until it has that many: a subject first written while it reads can then
//     stand in for one rewritten meanwhile, which the result may lack.
//
// Subjects first written while it reads may be in the result or not. A purge can leave fewer
// subjects than it expects: after idle without a message it asks which subjects the stream still
// holds, and is done when it read them all. Otherwise nothing for idle is an error (the server
// stopped delivering): the caller reads again later.
func LastPerSubject(ctx context.Context, s jetstream.Stream, filter string, headersOnly bool, idle time.Duration) (map[string]LastMsg, error) {
	var want int               // the subjects to read
	var need map[string]uint64 // which they are (filter only), until read
	if filter != "" {
		subs, err := subjects(ctx, s, filter)
		if err != nil {
			return nil, err
		}
		need, want = subs, len(subs)
	} else {
		info, err := s.Info(ctx)
		if err != nil {
			return nil, err
		}
		want = int(info.State.NumSubjects)
	}
	if testHookCounted != nil {
		testHookCounted()
	}
	if want == 0 {
		return map[string]LastMsg{}, nil
	}
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{
		DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy, FilterSubject: cmp.Or(filter, ">"),
		AckPolicy: jetstream.AckNonePolicy, HeadersOnly: headersOnly, MemoryStorage: true, Replicas: 1,
		InactiveThreshold: idle, // the server removes it once the read is done
	})
	if err != nil {
		return nil, err
	}
	out := make(map[string]LastMsg, want)
	left := func() int {
		if need != nil {
			return len(need)
		}
		return want - len(out)
	}
	for left() > 0 {
		n, err := readLast(ctx, c, min(left(), lastBatch), idle, out, need)
		if err != nil {
			return nil, err
		}
		if n > 0 {
			continue
		}
		// Nothing for idle: subjects purged meanwhile (a key-value bucket's purge of a db's
		// keys, say) are not delivered. Done when the stream holds no subject that was not read.
		now, err := subjects(ctx, s, filter)
		if err != nil {
			return nil, err
		}
		for subject := range now {
			if _, ok := out[subject]; !ok {
				return nil, fmt.Errorf("stream %s: %d of its %d subjects read, then nothing for %s", s.CachedInfo().Config.Name, len(out), len(now), idle)
			}
		}
		for subject := range out {
			if _, ok := now[subject]; !ok {
				delete(out, subject)
			}
		}
		return out, nil
	}
	return out, nil
}

// subjects returns the subjects of stream s that filter matches ("" for all), with how many
// messages each has.
func subjects(ctx context.Context, s jetstream.Stream, filter string) (map[string]uint64, error) {
	if filter == "" {
		filter = ">"
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		return nil, err
	}
	return info.State.Subjects, nil
}

// testHookCounted runs once LastPerSubject has counted the subjects (tests purge some then).
var testHookCounted func()

// lastBatch is the most messages one read of LastPerSubject asks for.
const lastBatch = 10_000

// readLast reads up to n messages of c into out, removing their subjects from need, waiting at
// most idle for them, and returns how many it read.
func readLast(ctx context.Context, c jetstream.Consumer, n int, idle time.Duration, out map[string]LastMsg, need map[string]uint64) (int, error) {
	fetchCtx, cancel := context.WithTimeout(ctx, idle)
	defer cancel()
	batch, err := c.Fetch(n, jetstream.FetchContext(fetchCtx))
	if err != nil {
		return 0, err
	}
	read := 0
	for m := range batch.Messages() {
		read++
		md, err := m.Metadata()
		if err != nil {
			return read, err
		}
		// Past each subject's last message at its start, the consumer delivers every new
		// message: a subject written again meanwhile comes twice. The latest one counts.
		if l, ok := out[m.Subject()]; !ok || md.Sequence.Stream > l.Seq {
			out[m.Subject()] = LastMsg{Seq: md.Sequence.Stream, Header: m.Headers(), Data: m.Data()}
		}
		delete(need, m.Subject())
	}
	if err := ctx.Err(); err != nil {
		return read, err
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
		return read, err
	}
	return read, nil
}
