package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"

	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/webhook"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// bucketCheckTTL is how long an opened mirror bucket (and its max value size) is reused before
// it is looked up again (so a bucket deleted or edited by hand is noticed).
const bucketCheckTTL = 30 * time.Second

// maxSubject bounds the longest subject a mirror key is used in (the direct get's
// $JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>), well within NATS' 4096-byte control line
// (which also holds the reply subject): a longer one would make the server close the connection.
const maxSubject = 3584

// payloadMargin is kept free of a message's max payload for the headers a KV write carries.
const payloadMargin = 1024

// kvManager is the part of jetstream.JetStream that mirror rules use: the buckets, and the
// connection for reads at a bucket's leader.
type kvManager interface {
	KeyValue(ctx context.Context, bucket string) (jetstream.KeyValue, error)
	CreateKeyValue(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error)
	PublishMsg(ctx context.Context, msg *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error)
	Stream(ctx context.Context, stream string) (jetstream.Stream, error)
	Conn() *nats.Conn
}

// mirrorWriter keeps the doc-state mirrors of `mirror` rules: the winning revision of every
// matching doc in a NATS KV bucket, key mirrorkey.Encode(db, doc id), a deleted doc a KV delete.
// It creates a missing bucket (history 1, replicas SPIEGEL_STREAM_REPLICAS). Safe for concurrent
// use.
type mirrorWriter struct {
	js         kvManager
	replicas   int
	maxPayload func() int64 // the connection's max payload (0: unknown)

	mu      sync.Mutex
	buckets map[string]*mirrorBucket
}

type mirrorBucket struct {
	kv       jetstream.KeyValue
	js       kvManager  // fenced writes (write)
	nc       *nats.Conn // reads of the bucket's stream at its leader (leaderMsg)
	name     string
	stream   string // the bucket's stream, KV_<bucket>
	handle   jetstream.Stream
	maxValue int // the largest value written as is
	// serial: the bucket is replicated, where JetStream refuses a write whose fence check is
	// made while another on the same fence is in flight: a job's writes go one at a time.
	serial bool
	// atomic: the bucket's stream takes atomic batches (allow_atomic): a replicated bucket's
	// page of writes that need no read goes as one (see writeWindow).
	atomic bool
	opened time.Time
}

// bucketMsg is a message of a bucket's stream.
type bucketMsg struct {
	Subject string
	Seq     uint64
	Header  nats.Header
	Data    []byte
}

// leaderMsg reads one message of the bucket's stream, as req asks ({"seq": n}, or
// {"last_by_subj": subject}, a delete marker included), with the JetStream API's message get,
// which only the stream's leader answers; found is false when there is none. KV buckets allow
// direct gets by default, which any replica answers, one that lags behind the leader included:
// read so, a key whose doc the mirror deleted a moment before (a db's keys dropped before it is
// mirrored again) could still show the doc's revision, and the write that brings the doc back
// was skipped as done — seen in a chaos run on a three-node JetStream, where that doc stayed
// missing from the mirror. Every read that decides a write, or a heal, is made here.
func (b *mirrorBucket) leaderMsg(ctx context.Context, req map[string]any, what string) (bucketMsg, bool, error) {
	var answer struct {
		Message *struct {
			Subject string `json:"subject"`
			Seq     uint64 `json:"seq"`
			Headers []byte `json:"hdrs"`
			Data    []byte `json:"data"`
		} `json:"message"`
	}
	apiErr, err := streamRequest(ctx, b.nc, b.stream, "STREAM.MSG.GET", req, &answer, what)
	switch {
	case err != nil:
		return bucketMsg{}, false, err
	case apiErr != nil && (apiErr.ErrCode == errCodeNoMessage || apiErr.ErrCode == errCodeSeqNotFound):
		return bucketMsg{}, false, nil
	case apiErr != nil:
		return bucketMsg{}, false, apiErr
	case answer.Message == nil:
		return bucketMsg{}, false, fmt.Errorf("%s in stream %s: empty answer", what, b.stream)
	}
	m := bucketMsg{Subject: answer.Message.Subject, Seq: answer.Message.Seq, Data: answer.Message.Data}
	if len(answer.Message.Headers) > 0 {
		hdr, err := nats.DecodeHeadersMsg(answer.Message.Headers)
		if err != nil {
			return bucketMsg{}, false, fmt.Errorf("%s in stream %s: unreadable headers: %w", what, b.stream, err)
		}
		m.Header = hdr
	}
	return m, true, nil
}

func newMirrorWriter(js kvManager, replicas int, maxPayload func() int64) *mirrorWriter {
	return &mirrorWriter{js: js, replicas: max(replicas, 1), maxPayload: maxPayload, buckets: map[string]*mirrorBucket{}}
}

// bucket opens the bucket named name, creating it when it does not exist.
func (m *mirrorWriter) bucket(ctx context.Context, name string) (*mirrorBucket, error) {
	m.mu.Lock()
	b, ok := m.buckets[name]
	m.mu.Unlock()
	if ok && time.Since(b.opened) < bucketCheckTTL {
		return b, nil
	}
	kv, err := m.js.KeyValue(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = m.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: name, History: 1, Replicas: m.replicas,
			Description: "Spiegel doc-state mirror: the winning revision of each doc, key <b64url(db)>.<b64url(doc id)>",
		})
		if errors.Is(err, jetstream.ErrBucketExists) { // created meanwhile by another consumer
			kv, err = m.js.KeyValue(ctx, name)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("open mirror bucket %s: %w", name, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("read mirror bucket %s: %w", name, err)
	}
	limit := int64(1<<31 - 1)
	if v := st.Config().MaxValueSize; v > 0 {
		limit = int64(v)
	}
	if m.maxPayload != nil {
		if p := m.maxPayload(); p > payloadMargin {
			limit = min(limit, p-payloadMargin)
		}
	}
	handle, err := m.js.Stream(ctx, "KV_"+name)
	if err != nil {
		return nil, fmt.Errorf("open the stream of mirror bucket %s: %w", name, err)
	}
	b = &mirrorBucket{kv: kv, js: m.js, nc: m.js.Conn(), name: name, stream: "KV_" + name, handle: handle, maxValue: int(limit),
		serial: st.Config().Replicas > 1, opened: time.Now()}
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok && bs.StreamInfo() != nil {
		b.atomic = bs.StreamInfo().Config.AllowAtomicPublish
	}
	m.mu.Lock()
	m.buckets[name] = b
	m.mu.Unlock()
	return b, nil
}

// tooLarge is the value mirrored instead of a doc larger than the bucket's max value size.
type tooLarge struct {
	ID       string `json:"_id"`
	Rev      string `json:"_rev"`
	TooLarge bool   `json:"too_large"`
	Size     int    `json:"size"`
}

// errDBClaimed: a mirror write refused by the job's fence of its db (see claimDB). It is an
// errFenced: the job stops and is not retried in place.
var errDBClaimed error = dbClaimedError{}

type dbClaimedError struct{}

func (dbClaimedError) Error() string {
	return "fenced: a later job claimed the db in the bucket since this one did; this job stops and runs again from its checkpoint"
}

func (dbClaimedError) Is(target error) bool { return target == errFenced }

// claimDB makes the job in ctx the holder of db's keys in bucket: it writes db's fence key
// (mirrorkey.Fence) and keeps the write's sequence as the job's fence, which every later write and
// delete of the job's in the bucket expects as the fence key's last message (JetStream's expected
// last subject sequence, checked on the fence's subject). A job claims before it reads anything
// of the db, so a job that claimed after it — a redelivery after a lease ran out, the first job
// of a db created again — moves the fence before writing or dropping anything, and from then on
// every write of the earlier job is refused (errFenced), whatever time it is sent at: a process
// paused (or cut off) past its lease, between its lease check and its write, cannot bring back a
// doc its successor deleted, write an older revision over a newer one, or leave a key of a db
// that was deleted and created again. Leases time the turns; the fence enforces them.
func (m *mirrorWriter) claimDB(ctx context.Context, bucket, db string, timeout time.Duration) error {
	p := mirrorPointOf(ctx, bucket)
	if p == nil {
		return fmt.Errorf("mirror %s: claim db %s outside a job", bucket, db)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	b, err := m.bucket(ctx, bucket)
	if err != nil {
		return err
	}
	if !worker.Held(ctx) {
		return worker.ErrLeaseLost
	}
	value, _ := json.Marshal(struct {
		DB        string    `json:"db"`
		ClaimedAt time.Time `json:"claimed_at"`
	}{db, time.Now().UTC()})
	key := mirrorkey.Fence(db)
	seq, err := b.kv.Put(ctx, key, value)
	if err != nil {
		return fmt.Errorf("mirror %s: claim the keys of db %s (key %s): %w", bucket, db, key, err)
	}
	p.claimed("$KV."+bucket+"."+key, seq)
	return nil
}

// write stores value under key (a KV delete when del), under the job's fence of the key's db (see
// claimDB), and returns the write's sequence. A write the fence refused wraps errFenced.
func (b *mirrorBucket) write(ctx context.Context, key string, value []byte, del bool) (uint64, error) {
	subject, seq, ok := mirrorPointOf(ctx, b.name).fence()
	if !ok {
		return 0, fmt.Errorf("mirror %s: write key %s without a claim of its db", b.name, key)
	}
	msg := kvWrite(b.name, key, value, del)
	fenceOn(msg, subject, seq)
	ack, err := b.js.PublishMsg(ctx, msg)
	switch {
	case err != nil && wrongLast(err):
		return 0, errDBClaimed
	case err != nil:
		return 0, err
	}
	return ack.Sequence, nil
}

// kvWrite returns the message that writes value under key of bucket (a KV delete when del).
func kvWrite(bucket, key string, value []byte, del bool) *nats.Msg {
	msg := nats.NewMsg("$KV." + bucket + "." + key)
	msg.Data = value
	if del {
		msg.Header.Set("KV-Operation", "DEL")
	}
	return msg
}

// fenceOn makes msg expect the fence key's subject to hold seq as its last message (see claimDB).
func fenceOn(msg *nats.Msg, subject string, seq uint64) {
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(seq, 10))
	msg.Header.Set(jetstream.ExpectedLastSubjSeqSubjHeader, subject)
}

// attempt returns the mirror write of change c of db into bucket as a retryable action: the
// doc's winning revision (the change's doc) becomes the key's value, a deleted doc deletes the
// key. Every write is made under the job's fence of db (claimDB): one refused means a later job
// holds the db, and the attempt fails with errFenced, which is not retried. A key that already
// holds the change's revision is left alone, so a replay or a re-dispatch rewrites nothing. A doc
// larger than the bucket's max value size is mirrored as {"_id","_rev","too_large":true,"size"}
// and the attempt fails permanently, so that the caller dead-letters it and goes on with the db's
// next change.
func (m *mirrorWriter) attempt(bucket, db string, c change, timeout time.Duration) webhook.Attempt {
	return func(ctx context.Context) (int, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		b, err := m.bucket(ctx, bucket)
		if err != nil {
			return 0, err
		}
		key := mirrorkey.Encode(db, c.ID)
		if n := len("$JS.API.DIRECT.GET.KV_" + bucket + ".$KV." + bucket + "." + key); n > maxSubject {
			return 0, fmt.Errorf("%w: mirror %s: doc %s: db name and doc id too long for a KV key (%d bytes of subject, at most %d)",
				webhook.ErrBadRequest, bucket, logIDOf(c.ID), n, maxSubject)
		}
		// The key's last message, a delete marker included: a key that holds the change's
		// revision already, or a deleted doc's key that holds nothing, needs no write.
		var last uint64
		var gone bool // the last message is a delete marker
		var held struct {
			Rev string `json:"_rev"`
		}
		subject := "$KV." + bucket + "." + key
		mp := mirrorPointOf(ctx, bucket)
		if holds, known := mp.holds(key); known {
			// The job knows the db's keys: a deleted doc it did not write needs nothing, and
			// any other change is written without a read (at worst a revision again).
			gone = !holds
			if holds {
				last = 1
			}
		} else {
			cur, found, err := b.leaderMsg(ctx, map[string]any{"last_by_subj": subject}, "read key "+key)
			switch {
			case err != nil:
				return 0, fmt.Errorf("mirror %s: %w", bucket, err)
			case found:
				last = cur.Seq
				if natsjs.KVDeleted(cur.Header) {
					gone = true
				} else {
					_ = json.Unmarshal(cur.Data, &held)
				}
			}
		}
		if !worker.Held(ctx) { // no write is sent once the lease ran out; the fence refuses a late one
			return 0, worker.ErrLeaseLost
		}
		if c.Deleted {
			if last == 0 || gone {
				return 0, nil
			}
			if _, err := b.write(ctx, key, nil, true); err != nil {
				return 0, fmt.Errorf("mirror %s: delete key %s (doc %s): %w", bucket, key, c.ID, err)
			}
			mp.wroteKey(key, true)
			return 0, nil
		}
		if last != 0 && !gone && held.Rev == c.rev() {
			return 0, nil // already mirrored
		}
		if len(c.Doc) == 0 {
			return 0, fmt.Errorf("%w: mirror %s: change of doc %s has no doc body", webhook.ErrBadRequest, bucket, c.ID)
		}
		value, large := []byte(c.Doc), len(c.Doc) > b.maxValue
		if large {
			value, _ = json.Marshal(tooLarge{ID: c.ID, Rev: c.rev(), TooLarge: true, Size: len(c.Doc)})
		}
		rev, err := b.write(ctx, key, value, false)
		if err != nil {
			return 0, fmt.Errorf("mirror %s: write key %s (doc %s rev %s): %w", bucket, key, c.ID, c.rev(), err)
		}
		mp.wrote(subject, rev)
		mp.wroteKey(key, false)
		if large {
			return 0, fmt.Errorf("%w: mirror %s: doc %s rev %s is %d bytes, more than the bucket's max value size %d: mirrored as a too_large reference",
				webhook.ErrBadRequest, bucket, c.ID, c.rev(), len(c.Doc), b.maxValue)
		}
		return 0, nil
	}
}

// forgetDB removes db's fence from bucket (a purge of the fence key's subject: no delete marker
// left), for a db that does not exist any more, once its keys are dropped. A job that claims the
// db later writes a new one; a holder whose claim it removed has every write refused, as after
// another claim.
func (m *mirrorWriter) forgetDB(ctx context.Context, bucket, db string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	b, err := m.bucket(ctx, bucket)
	if err != nil {
		return err
	}
	subject := "$KV." + bucket + "." + mirrorkey.Fence(db)
	apiErr, err := streamRequest(ctx, b.nc, b.stream, "STREAM.PURGE", map[string]any{"filter": subject}, nil, "purge the fence of db "+db)
	if err != nil {
		return err
	}
	if apiErr != nil {
		return apiErr
	}
	return nil
}

// serial reports whether a job's writes into bucket go one at a time (see mirrorBucket.serial).
func (m *mirrorWriter) serial(bucket string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.buckets[bucket]
	return ok && b.serial
}

// dropDB deletes every key of db from bucket (KV deletes, as for deleted docs), under the job's
// fence of db: the mirror of a db that no longer exists, or that is about to be rebuilt from the
// beginning of its feed (a rule without a checkpoint in db: a new rule, or a db deleted and
// created again, whose old docs must not outlive it). It returns how many keys it deleted.
func (m *mirrorWriter) dropDB(ctx context.Context, bucket, db string) (int, error) {
	b, err := m.bucket(ctx, bucket)
	if err != nil {
		return 0, err
	}
	keys, err := b.liveKeys(ctx, db)
	if err != nil {
		return 0, fmt.Errorf("mirror %s: list the keys of db %s: %w", bucket, db, err)
	}
	for _, k := range keys {
		if !worker.Held(ctx) {
			return 0, worker.ErrLeaseLost
		}
		seq, err := b.write(ctx, k, nil, true)
		if err != nil {
			return 0, fmt.Errorf("mirror %s: delete key %s of db %s: %w", bucket, k, db, err)
		}
		// The drop is a write of the job like any other: should the bucket lose it, the
		// checkpoint's point says so (checkMirror), and the gap is reported.
		mirrorPointOf(ctx, bucket).wrote("$KV."+bucket+"."+k, seq)
	}
	return len(keys), nil
}

// liveKeys returns the keys of db that the bucket holds a value under (not a delete or purge
// marker). It reads them with natsjs.LastPerSubject, not the KV key listing, which can end
// early: a chaos run's drop of a recreated db listed 3 of its 20 keys and left the others in the
// mirror. Only the job that holds db's fence writes db's keys, so they do not change while the
// job reads them.
func (b *mirrorBucket) liveKeys(ctx context.Context, db string) ([]string, error) {
	prefix := "$KV." + b.name + "."
	last, err := natsjs.LastPerSubject(ctx, b.handle, prefix+mirrorkey.DBPrefix(db), true, listIdle)
	if err != nil {
		return nil, err
	}
	var keys []string
	for subject, m := range last {
		if !natsjs.KVDeleted(m.Header) {
			keys = append(keys, subject[len(prefix):])
		}
	}
	slices.Sort(keys)
	return keys, nil
}

// listIdle bounds the wait for the next message while liveKeys reads a db's keys.
const listIdle = 5 * time.Second

// mirrorPoint is a job's state in a mirror bucket: its fence of the db (claimDB), and its latest
// write: the key's subject and the write's stream sequence, kept in the rule's checkpoint
// (checkpoint.OnChangePoint.Stream) so that the next job can tell whether the bucket lost it (see
// checkMirror).
type mirrorPoint struct {
	mu           sync.Mutex
	subject      string
	seq          uint64
	fenceSubject string
	fenceSeq     uint64
	// known: the bucket holds no live key of the db but those this job wrote, which written
	// names (the job dropped the db's keys as it began: see begin). Writes then need no read of
	// their key. Past maxWritten keys the job reads keys again.
	known   bool
	written map[string]struct{}
}

// maxWritten bounds the keys a job remembers writing (about 100 bytes each).
const maxWritten = 1 << 20

// begin notes that the db's keys were dropped: from now on the job knows every live key of the
// db in the bucket.
func (p *mirrorPoint) begin() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.known, p.written = true, map[string]struct{}{}
}

// holds reports, when the job knows the db's keys (known), whether key holds a doc.
func (p *mirrorPoint) holds(key string) (holds, known bool) {
	if p == nil {
		return false, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.known {
		return false, false
	}
	_, holds = p.written[key]
	return holds, true
}

// wroteKey notes that key holds a doc now (del false) or nothing (del true).
func (p *mirrorPoint) wroteKey(key string, del bool) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case !p.known:
	case del:
		delete(p.written, key)
	case len(p.written) >= maxWritten:
		p.known, p.written = false, nil
	default:
		p.written[key] = struct{}{}
	}
}

// claimed notes the job's claim of its db, stored at seq on subject.
func (p *mirrorPoint) claimed(subject string, seq uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fenceSubject, p.fenceSeq = subject, seq
}

// fence returns the job's claim of its db (ok false: none).
func (p *mirrorPoint) fence() (subject string, seq uint64, ok bool) {
	if p == nil {
		return "", 0, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.fenceSubject, p.fenceSeq, p.fenceSeq != 0
}

// wrote notes a write stored at seq.
func (p *mirrorPoint) wrote(subject string, seq uint64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if seq > p.seq {
		p.subject, p.seq = subject, seq
	}
}

// point returns the latest write (nil: none).
func (p *mirrorPoint) point() *checkpoint.StreamPoint {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.seq == 0 {
		return nil
	}
	return &checkpoint.StreamPoint{Subject: p.subject, Seq: p.seq}
}

type mirrorPointsKey struct{}

// withMirrorPoints returns ctx carrying a new set of mirror points for one job.
func withMirrorPoints(ctx context.Context) context.Context {
	return context.WithValue(ctx, mirrorPointsKey{}, &perJob[mirrorPoint]{m: map[string]*mirrorPoint{}})
}

// mirrorPointOf returns the job's mirror point of bucket (nil when ctx carries none).
func mirrorPointOf(ctx context.Context, bucket string) *mirrorPoint {
	ps, _ := ctx.Value(mirrorPointsKey{}).(*perJob[mirrorPoint])
	if ps == nil {
		return nil
	}
	return ps.of(bucket)
}

// firstSeq returns the first sequence of the bucket's stream, as its leader answers.
func (b *mirrorBucket) firstSeq(ctx context.Context) (uint64, error) {
	var answer struct {
		State struct {
			FirstSeq uint64 `json:"first_seq"`
		} `json:"state"`
	}
	apiErr, err := streamRequest(ctx, b.nc, b.stream, "STREAM.INFO", map[string]any{}, &answer, "read the stream info")
	switch {
	case err != nil:
		return 0, err
	case apiErr != nil:
		return 0, apiErr
	}
	return answer.State.FirstSeq, nil
}

// logIDOf shortens a doc id for an error message.
func logIDOf(id string) string {
	if len(id) > 80 {
		return fmt.Sprintf("%q… (%d bytes)", id[:80], len(id))
	}
	return id
}

// writeWindow writes, all at once, the changes of acts that need no read: those of a job that
// knows the db's keys (mirrorPoint.begin: a job that began the db's mirror from scratch), each a
// fenced write or delete of a key of its own (a page lists each doc once, so their order does not
// matter), or nothing for a deleted doc the job did not write. On a single-replica bucket the
// writes are pipelined, each fenced; a replicated bucket refuses a fence check while another on
// the same fence is in flight, so there they go as atomic batches of up to maxAtomic, the first
// write of each fenced, when the bucket allows atomic batches (allow_atomic), and one at a time
// otherwise (their actions). Changes whose key is too long, whose doc is too large or has no body
// are left to their actions (attempt), which say why. done marks the changes written; the others
// (also any whose write failed) go through their actions. err is errDBClaimed when the fence
// refused a write: a later job holds the db.
func (m *mirrorWriter) writeWindow(ctx context.Context, bucket, db string, acts []*action, timeout time.Duration) (done []bool, err error) {
	mp := mirrorPointOf(ctx, bucket)
	if _, known := mp.holds(""); !known || !worker.Held(ctx) {
		return nil, nil
	}
	b, err := m.bucket(ctx, bucket)
	if err != nil || b.serial && !b.atomic {
		return nil, nil // the actions say why, or write one at a time
	}
	ap, ok := b.js.(asyncPublisher)
	fenceSubject, fenceSeq, claimed := mp.fence()
	if !ok || !claimed {
		return nil, nil
	}
	type write struct {
		i   int
		key string
		del bool
		msg *nats.Msg
	}
	var writes []write
	done = make([]bool, len(acts))
	for i, a := range acts {
		if a == nil || a.owner != i {
			continue
		}
		c := a.c
		key := mirrorkey.Encode(db, c.ID)
		if len("$JS.API.DIRECT.GET.KV_"+bucket+".$KV."+bucket+"."+key) > maxSubject {
			continue
		}
		holds, _ := mp.holds(key)
		if c.Deleted && !holds {
			done[i] = true // nothing of the doc in the bucket
			continue
		}
		if !c.Deleted && (len(c.Doc) == 0 || len(c.Doc) > b.maxValue) {
			continue
		}
		var value []byte
		if !c.Deleted {
			value = c.Doc
		}
		writes = append(writes, write{i: i, key: key, del: c.Deleted, msg: kvWrite(bucket, key, value, c.Deleted)})
	}
	stored := func(w write, seq uint64) {
		done[w.i] = true
		if !w.del {
			mp.wrote(w.msg.Subject, seq)
		}
		mp.wroteKey(w.key, w.del)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if b.serial {
		for len(writes) > 0 {
			chunk := writes[:min(len(writes), maxAtomic)]
			writes = writes[len(chunk):]
			msgs := make([]*nats.Msg, len(chunk))
			for j, w := range chunk {
				msgs[j] = w.msg
			}
			fenceOn(msgs[0], fenceSubject, fenceSeq)
			seq, err := sendAtomic(ctx, b.nc, msgs, timeout)
			switch {
			case errors.Is(err, errFenced):
				return done, errDBClaimed
			case err != nil:
				return done, nil
			}
			for j, w := range chunk { // a batch's messages are stored at consecutive sequences
				stored(w, seq-uint64(len(chunk)-1-j))
			}
		}
		return done, nil
	}
	type pending struct {
		write
		fut jetstream.PubAckFuture
	}
	var sent []pending
	for _, w := range writes {
		fenceOn(w.msg, fenceSubject, fenceSeq)
		fut, err := ap.PublishMsgAsync(w.msg, jetstream.WithRetryAttempts(0))
		if err != nil {
			break
		}
		sent = append(sent, pending{w, fut})
	}
	for _, p := range sent {
		select {
		case ack := <-p.fut.Ok():
			stored(p.write, ack.Sequence)
		case werr := <-p.fut.Err():
			if wrongLast(werr) {
				err = errDBClaimed
			}
		case <-ctx.Done():
			return done, err
		}
	}
	return done, err
}

// maxAtomic is the most writes sent as one atomic batch (nats-server's default limit).
const maxAtomic = 1000
