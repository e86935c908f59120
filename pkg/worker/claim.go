package worker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/natsjs"
)

// errClaimed means another instance holds the db's lease: its job runs there.
var errClaimed = errors.New("another instance holds the lease of this db's job")

// A job's lease rests on a message of the lease stream (natsjs.Topology.LeaseStreamConfig), not
// on the work consumer's ack timer. nats-server answers an InProgress before the new delivery
// time is committed, and a consumer leader elected after that restores the last committed
// state and redelivers the job: an instance whose InProgress was confirmed could keep acting
// while another ran the job. The lease message instead is a stream write, answered only once it
// is stored (on a replicated stream: committed by a quorum), so it survives any leader change:
//
//   - acquire: publish on the (group, db)'s lease subject, expecting it to hold no message, with a
//     time to live of AckWait. A subject that holds one (another instance's live lease) refuses
//     it: the job runs there, and this delivery is given back.
//   - renew: publish again, expecting the subject's last message to be this instance's; its time
//     to live starts again. A refusal means the lease expired and another instance took it.
//   - release: delete the message, by its sequence (a later holder's has another), before the
//     job is settled; a holder that dies leaves a message that expires after AckWait.
//
// The holder counts its lease from when it sent the write that the stream confirmed, the
// server its time to live from when it stored it, later: the holder stops first (see lease).
// A write whose answer was lost and that is sent again is refused as if another held the
// lease; the subject's last message, read at the stream's leader, tells whether it is the
// holder's own (its token).
type claim struct {
	js      jetstream.JetStream
	stream  string // the lease stream
	subject string // the (group, db)'s lease subject
	ttl     time.Duration
	token   []byte // this claim's, in each of its messages
	seq     uint64 // the stream sequence of its last message (0: none yet)
}

// newClaim returns a claim of subject for this delivery, not acquired yet.
func newClaim(js jetstream.JetStream, stream, subject string, ttl time.Duration) (*claim, error) {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("lease token: %w", err)
	}
	return &claim{js: js, stream: stream, subject: subject, ttl: max(ttl, time.Second), token: []byte(hex.EncodeToString(b[:]))}, nil
}

// write stores the claim's next lease message: the first (acquire) or a renewal. It returns
// errClaimed when the subject holds another instance's message.
func (c *claim) write(ctx context.Context) error {
	msg := nats.NewMsg(c.subject)
	msg.Data = c.token
	ack, err := c.js.PublishMsg(ctx, msg, jetstream.WithExpectStream(c.stream),
		jetstream.WithExpectLastSequencePerSubject(c.seq), jetstream.WithMsgTTL(c.ttl))
	switch {
	case err == nil:
		c.seq = ack.Sequence
		return nil
	case natsjs.IsWrongLastSequence(err):
		return c.own(ctx)
	}
	return fmt.Errorf("write lease %s: %w", c.subject, err)
}

// own checks, after a refused write, whether the subject's last message is this claim's (its
// earlier write whose answer was lost): then the claim goes on from it; otherwise errClaimed.
func (c *claim) own(ctx context.Context) error {
	st, err := c.js.Stream(ctx, c.stream)
	if err != nil {
		return fmt.Errorf("read lease %s: %w", c.subject, err)
	}
	m, err := st.GetLastMsgForSubject(ctx, c.subject)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return errClaimed // expired meanwhile: the delivery is given back, a later one acquires
	case err != nil:
		return fmt.Errorf("read lease %s: %w", c.subject, err)
	case string(m.Data) != string(c.token):
		return errClaimed
	}
	c.seq = m.Sequence
	return nil
}

// release deletes the claim's last lease message. One gone already (expired) is no error; a
// failure is harmless (the message expires) and is returned for logging.
func (c *claim) release(ctx context.Context) error {
	if c.seq == 0 {
		return nil
	}
	// One API request (the stream handle would cost a stream info first).
	req := fmt.Appendf(nil, `{"seq":%d,"no_erase":true}`, c.seq)
	resp, err := c.js.Conn().RequestWithContext(ctx, "$JS.API.STREAM.MSG.DELETE."+c.stream, req)
	if err != nil {
		return fmt.Errorf("release lease %s: %w", c.subject, err)
	}
	var answer struct {
		Error *struct {
			Code        int    `json:"err_code"`
			Description string `json:"description"`
		} `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &answer); err != nil {
		return fmt.Errorf("release lease %s: unreadable answer: %w", c.subject, err)
	}
	if e := answer.Error; e != nil && !natsjs.MsgGone(e.Code, e.Description) {
		return fmt.Errorf("release lease %s: %s (%d)", c.subject, e.Description, e.Code)
	}
	return nil
}
