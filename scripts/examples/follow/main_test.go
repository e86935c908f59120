package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// publish stores a change the way a subject rule does: the change JSON on the db's subject,
// message id <db>/<doc id>/<rev> (or the replay's form with the Spiegel-Replay header).
func publish(t *testing.T, js jetstream.JetStream, db, id, rev string, deleted bool, replay string) {
	t.Helper()
	data, err := json.Marshal(map[string]any{"db": db, "seq": "s-" + rev, "id": id, "changes": []map[string]string{{"rev": rev}},
		"deleted": deleted, "doc": map[string]any{"_id": id, "_rev": rev}})
	require.NoError(t, err)
	msg := &nats.Msg{Subject: SubjectFor("spiegel", db), Data: data, Header: nats.Header{}}
	msg.Header.Set(jetstream.MsgIDHeader, db+"/"+id+"/"+rev)
	if replay != "" {
		msg.Header.Set(jetstream.MsgIDHeader, "replay/"+replay+"/"+db+"/"+id+"/"+rev)
		msg.Header.Set("Spiegel-Replay", replay)
	}
	_, err = js.PublishMsg(t.Context(), msg)
	require.NoError(t, err)
}

// collect follows opt until want changes arrived (or 30s passed) and returns them.
func collect(t *testing.T, js jetstream.JetStream, opt Options, want int) []Change {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var got []Change
	err := Follow(ctx, js, opt, func(c Change) error {
		got = append(got, c)
		if len(got) == want {
			cancel()
		}
		return nil
	})
	require.NoError(t, err)
	require.Len(t, got, want, "changes read before the deadline")
	return got
}

// The guide's example reads one db's changes in stream order from the start, a sequence or a
// time, through an ordered or a durable consumer, and rebuilds the docs' latest revisions.
func TestFollowRebuildsState(t *testing.T) {
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	require.NoError(t, natsjs.Ensure(t.Context(), js, natsjs.DefaultTopology("spiegel")))
	db, other := "userdb-alice/2026", "userdb-bob"
	publish(t, js, db, "a", "1-x", false, "")
	publish(t, js, other, "z", "1-z", false, "") // another db's subject: never read
	publish(t, js, db, "b", "1-y", false, "")
	publish(t, js, db, "a", "2-x", false, "")
	publish(t, js, db, "b", "2-y", true, "")
	publish(t, js, db, "a", "2-x", false, "") // a re-dispatch: deduplicated by its message id
	opt := Options{Stream: "SPIEGEL_CHANGES", Subject: SubjectFor("spiegel", db)}

	all := collect(t, js, opt, 4)
	var order []string
	state := State{}
	for _, c := range all {
		order = append(order, c.ID+"@"+c.Rev())
		state.Apply(c)
		assert.Equal(t, db, c.DB)
	}
	assert.Equal(t, []string{"a@1-x", "b@1-y", "a@2-x", "b@2-y"}, order, "stream order, this db only")
	assert.Equal(t, "2-x", state["a"].Rev())
	assert.True(t, state["b"].Deleted, "a deletion is kept as a tombstone")

	from := collect(t, js, Options{Stream: opt.Stream, Subject: opt.Subject, FromSeq: all[2].StreamSeq}, 2)
	assert.Equal(t, all[2].StreamSeq, from[0].StreamSeq, "starts at the sequence asked")
	since := collect(t, js, Options{Stream: opt.Stream, Subject: opt.Subject, From: all[3].Stored}, 1)
	assert.Equal(t, all[3].StreamSeq, since[0].StreamSeq, "starts at the time asked")

	// A replay publishes the history again under its id: a state rebuilt with Apply is unchanged.
	publish(t, js, db, "a", "2-x", false, "r1")
	replayed := collect(t, js, Options{Stream: opt.Stream, Subject: opt.Subject, FromSeq: all[3].StreamSeq + 1}, 1)
	assert.Equal(t, "r1", replayed[0].Replay)
	assert.False(t, state.Apply(replayed[0]), "a replayed change changes nothing")

	// A durable consumer resumes after the last change it acknowledged.
	// A change the stopped reader had already been sent is delivered again after AckWait.
	durable := Options{Stream: opt.Stream, Subject: opt.Subject, Durable: "alice-index", AckWait: time.Second}
	first := collect(t, js, durable, 2)
	rest := collect(t, js, durable, 3)
	assert.Equal(t, []uint64{all[0].StreamSeq, all[1].StreamSeq}, []uint64{first[0].StreamSeq, first[1].StreamSeq})
	assert.Equal(t, all[2].StreamSeq, rest[0].StreamSeq, "resumes after the last change acknowledged")
	assert.Equal(t, "r1", rest[2].Replay)
}

// The command refuses to run without a db, and says so.
func TestRunNeedsADB(t *testing.T) {
	var out strings.Builder
	err := run([]string{"-nats", "nats://127.0.0.1:1"}, &out)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "-db is required")
	assert.True(t, strings.HasPrefix(SubjectFor("spiegel", "a.b c"), "spiegel.changes."))
	assert.Len(t, strings.Split(SubjectFor("spiegel", "a.b c"), "."), 3, "any db name is one subject token")
}
