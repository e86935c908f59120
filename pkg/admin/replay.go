package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// replayPoll is how often WaitReplay reads the checkpoints (liveness only: a replay is done
// when its checkpoint says so).
const replayPoll = 500 * time.Millisecond

// ResetForReplay resets rule's checkpoint in db, trying again a few times: two commands
// resetting one checkpoint at once (a replay run twice) make one of the writes conflict.
func ResetForReplay(ctx context.Context, store *checkpoint.OnChangeStore, rule, db, since string) error {
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
	ReplayRunning    = "running"
	ReplayDone       = "done"
	ReplaySuperseded = "superseded" // another replay reset the checkpoint since
	ReplayGone       = "gone"       // the checkpoint is gone: the db was deleted
)

// WaitReplay waits, for at most wait, until every db's checkpoint says that the replay reached
// the end of its feed (or that it cannot: another replay reset it, the db is gone). It returns
// each db's state (Replay*). Every 5s meanwhile it calls progress with the number of dbs done.
func WaitReplay(ctx context.Context, store *checkpoint.OnChangeStore, rule, id string, dbs []string, wait time.Duration, progress func(done, total int)) map[string]string {
	states := make(map[string]string, len(dbs))
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	ticker := time.NewTicker(replayPoll)
	defer ticker.Stop()
	last := time.Now()
	for {
		running := 0
		for _, db := range dbs {
			if s := states[db]; s != "" && s != ReplayRunning {
				continue
			}
			p, err := store.Load(ctx, rule, db)
			switch got, active := p.Replay(); {
			case err != nil:
				states[db] = ReplayRunning // asked again next time
			case !p.Found:
				states[db] = ReplayGone
			case got != id:
				states[db] = ReplaySuperseded
			case active:
				states[db] = ReplayRunning
			default:
				states[db] = ReplayDone
			}
			if states[db] == ReplayRunning {
				running++
			}
		}
		if running == 0 {
			return states
		}
		if time.Since(last) >= 5*time.Second {
			last = time.Now()
			progress(len(dbs)-running, len(dbs))
		}
		select {
		case <-ctx.Done():
			return states
		case <-ticker.C:
		}
	}
}

// ReplayCounter counts the messages a replay stored in the stream of a subject rule.
type ReplayCounter struct {
	js     jetstream.JetStream
	stream string
	filter string // "" = the whole stream
	id     string
	start  jetstream.ConsumerConfig
}

// NewReplayCounter notes where the replay's messages start in the rule's stream: after the
// stream's last message now, or, for a replay resumed by id, within the stream's duplicate
// window (older messages cannot hold back the replay's publishes anyway).
func NewReplayCounter(ctx context.Context, js jetstream.JetStream, rule *rules.OnChange, id string, resumed bool) (*ReplayCounter, error) {
	c := &ReplayCounter{js: js, id: id, filter: subjectFilter(rule.Subject)}
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

// Count reads the rule's messages stored since the start noted and counts, per db, those of the
// replay.
func (c *ReplayCounter) Count(ctx context.Context) (map[string]int, error) {
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
