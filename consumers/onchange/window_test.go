package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// freezeAfterFirst freezes proxy right after the first publish it lets through once armed, once
// the server has it: a window's first change is stored, the rest of the window is held on its way.
type freezeAfterFirst struct {
	jetstream.JetStream
	nc    *nats.Conn
	proxy *natstest.Proxy
	armed atomic.Bool
}

func (p *freezeAfterFirst) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	ack, err := p.JetStream.PublishMsg(ctx, m, opts...)
	if p.armed.CompareAndSwap(true, false) {
		p.proxy.Freeze()
	}
	return ack, err
}

func (p *freezeAfterFirst) PublishMsgAsync(m *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	f, err := p.JetStream.PublishMsgAsync(m, opts...)
	if p.armed.CompareAndSwap(true, false) {
		_ = p.nc.Flush()
		p.proxy.Freeze()
	}
	return f, err
}

// TestStaleHolderWindowIsRefused: instance A's window is on its way (its first change, c, stored;
// d at 1-a and e held by a frozen connection) when instance B takes the job over and publishes the
// feed as it now is: c, e, then d at 2-b. When A's connection thaws, nothing of its window after c
// is stored: d at 1-a would follow d at 2-b. A's run ends fenced with c done.
func TestStaleHolderWindowIsRefused(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := orderStream(t, s, 0, false)
	proxy := s.NewProxy(t)
	ncA, err := nats.Connect(proxy.URL(), nats.ReconnectBufSize(-1))
	require.NoError(t, err)
	t.Cleanup(ncA.Close)
	jsA, err := jetstream.New(ncA)
	require.NoError(t, err)
	pubA := &freezeAfterFirst{JetStream: jsA, nc: ncA, proxy: proxy}
	hA, r := orderHandler(t, pubA)
	hB, _ := orderHandler(t, js)

	jobA := withFences(t.Context())
	require.NoError(t, publishPage(t, jobA, hA, r, "", []couch.Change{docRow("1", "a", "1-a"), docRow("2", "b", "1-a")}).err)
	pubA.armed.Store(true)
	late := make(chan batchResult, 1)
	go func() {
		late <- publishPage(t, jobA, hA, r, "2", []couch.Change{docRow("3", "c", "1-a"), docRow("4", "d", "1-a"), docRow("5", "e", "1-a")})
	}()
	require.Eventually(t, func() bool { return proxy.HeldBytes() > 0 }, 10*time.Second, time.Millisecond, "A's window is on its way")
	require.Eventually(t, func() bool { return storedCount(t, js) == 3 }, 10*time.Second, time.Millisecond, "the window's first change is stored")
	require.Equal(t, []string{"db/a/1-a", "db/b/1-a", "db/c/1-a"}, stored(t, js))

	res := publishPage(t, withFences(t.Context()), hB, r, "2", []couch.Change{docRow("3", "c", "1-a"), docRow("5", "e", "1-a"), docRow("6", "d", "2-b")})
	require.NoError(t, res.err)
	require.Equal(t, 3, res.done)

	proxy.Thaw()
	select {
	case res := <-late:
		assert.True(t, errors.Is(res.err, errFenced), "A's run ends fenced: %v", res.err)
		assert.Equal(t, 1, res.done, "A's checkpoint moves past c only")
	case <-time.After(30 * time.Second):
		t.Fatal("A's page did not end")
	}
	assert.Equal(t, []string{"db/a/1-a", "db/b/1-a", "db/c/1-a", "db/e/1-a", "db/d/2-b"}, stored(t, js),
		"nothing of A's window after c is stored after B's changes")
}

// TestWindowsOfTwoProcessesShareAStream: two processes (each with its own connection) publish
// the pages of two dbs into one stream at once, so that each one's messages land in the middle of
// the other's windows. Each subject ends up with its changes once, in feed order, their positions
// counting from 1 and each naming the message before it on the subject: what the gap check reads.
// On one server and on a three-node cluster with the stream R3 (no atomic batches).
func TestWindowsOfTwoProcessesShareAStream(t *testing.T) {
	t.Parallel()
	t.Run("R1", func(t *testing.T) {
		t.Parallel()
		s := natstest.Start(t)
		twoProcessWindows(t, s.URL(), orderStream(t, s, 0, false))
	})
	for _, replicas := range []int{1, 3} {
		t.Run(fmt.Sprintf("cluster R%d", replicas), func(t *testing.T) {
			t.Parallel()
			servers := natstest.StartCluster(t, 3)
			_, js := servers[0].Connect(t)
			var err error
			require.Eventually(t, func() bool { // a cluster just started may not place an R3 stream yet
				_, err = js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "CHG_CHANGES", Subjects: []string{"chg.>"},
					Duplicates: time.Hour, Storage: jetstream.FileStorage, Replicas: replicas})
				return err == nil
			}, 30*time.Second, 100*time.Millisecond, "create the stream: %v", err)
			twoProcessWindows(t, servers[1].URL(), js)
			st, err := js.Stream(t.Context(), "CHG_CHANGES")
			require.NoError(t, err)
			_, err = st.Info(t.Context())
			require.NoError(t, err, "the stream is still there")
		})
	}
}

func twoProcessWindows(t *testing.T, url string, js jetstream.JetStream) {
	const pages, perPage = 20, 50
	var wg sync.WaitGroup
	for p := range 2 {
		nc, err := nats.Connect(url)
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		jsP, err := jetstream.New(nc)
		require.NoError(t, err)
		h, r := orderHandler(t, jsP)
		db := fmt.Sprintf("db%d", p)
		ok, err := h.publisher.check(t.Context(), db, r, h.dead, h.log)
		require.NoError(t, err)
		require.True(t, ok)
		wg.Go(func() {
			job := withFences(t.Context())
			since := ""
			for pg := range pages {
				rows := make([]couch.Change, perPage)
				for i := range rows {
					n := pg*perPage + i
					rows[i] = couch.Change{Seq: strconv.Itoa(n + 1), ID: fmt.Sprintf("d%04d", n), Revs: []string{"1-a"}, Doc: []byte(`{}`)}
				}
				res := h.processBatch(job, db, r, since, "", rows, h.log)
				if !assert.NoError(t, res.err) || !assert.Equal(t, perPage, res.done) {
					return
				}
				since = rows[perPage-1].Seq
			}
		})
	}
	wg.Wait()
	st, err := js.Stream(t.Context(), "CHG_CHANGES")
	require.NoError(t, err)
	for p := range 2 {
		subject := fmt.Sprintf("chg.changes.db%d", p)
		var prev uint64
		for n := range pages * perPage {
			var m *jetstream.RawStreamMsg
			if n == 0 {
				m, err = st.GetMsg(t.Context(), 1, jetstream.WithGetMsgSubject(subject))
			} else {
				m, err = st.GetMsg(t.Context(), prev+1, jetstream.WithGetMsgSubject(subject))
			}
			require.NoError(t, err, "%s message %d", subject, n+1)
			require.Equal(t, fmt.Sprintf("db%d/d%04d/1-a", p, n), m.Header.Get(jetstream.MsgIDHeader), "%s in feed order", subject)
			require.Equal(t, strconv.Itoa(n+1), m.Header.Get(events.PositionHeader), "%s position", subject)
			require.Equal(t, strconv.FormatUint(prev, 10), m.Header.Get(events.PreviousHeader), "%s previous", subject)
			prev = m.Sequence
		}
		_, err = st.GetMsg(t.Context(), prev+1, jetstream.WithGetMsgSubject(subject))
		require.ErrorIs(t, err, jetstream.ErrMsgNotFound, "%s holds each change once", subject)
	}
}
