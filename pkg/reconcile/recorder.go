package reconcile

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// putTimeout bounds the put of one completion record.
const putTimeout = 5 * time.Second

// dbInfoReader reads a db's info (*couch.Client).
type dbInfoReader interface {
	DBInfo(ctx context.Context, db string) (couch.DBInfo, error)
}

// recordPutter writes completion records (*Records).
type recordPutter interface {
	Put(ctx context.Context, g events.Group, db, seq string) error
}

// Recorder writes the completion record of every successful job of a consumer (see Wrap).
type Recorder struct {
	dbs     dbInfoReader
	records recordPutter
	log     logrus.FieldLogger
}

// NewRecorder returns a recorder writing into records; dbs serves the read after a Settled job.
func NewRecorder(dbs dbInfoReader, records recordPutter, log logrus.FieldLogger) *Recorder {
	return &Recorder{dbs: dbs, records: records, log: log}
}

// vouchKey carries a job's vouchers (see Vouch, Settled).
type vouchKey struct{}

// vouchers collects what a handler vouched for during one job.
type vouchers struct {
	mu      sync.Mutex
	seqs    []string
	settled bool
}

// Vouch tells the recorder of ctx's job that the handler acted on every change of the job's db
// up to seq: the last_seq of a read of the db's changes feed that reached its end (a short or
// empty page), taken once the changes before it were done. A handler calls it once for each
// part of the job that got there (each rule); after a success the recorder records the earliest
// of them, the position every part has passed (couch.Covers; when the seqs cannot be ordered,
// nothing is recorded). Outside Wrap it does nothing.
func Vouch(ctx context.Context, seq string) {
	if v, ok := ctx.Value(vouchKey{}).(*vouchers); ok && seq != "" {
		v.mu.Lock()
		v.seqs = append(v.seqs, seq)
		v.mu.Unlock()
	}
}

// Settled tells the recorder of ctx's job that the handler stopped without reading the feed to
// its end for a reason that running the db again cannot fix (a rule that failed permanently
// and recorded a dead letter; it runs again on the db's next change). When nothing was vouched,
// the recorder then records the db's update_seq as read after the handler, so that the sweep
// does not run the db again for nothing.
func Settled(ctx context.Context) {
	if v, ok := ctx.Value(vouchKey{}).(*vouchers); ok {
		v.mu.Lock()
		v.settled = true
		v.mu.Unlock()
	}
}

// earliest returns the seq of seqs that each of the others covers (couch.Covers), or false when
// there is none: seqs that cannot be ordered (copies of different nodes), or none at all.
func earliest(seqs []string) (string, bool) {
	for _, s := range seqs {
		first := true
		for _, o := range seqs {
			if !couch.Covers(couch.Seq(o), couch.Seq(s)) {
				first = false
				break
			}
		}
		if first {
			return s, true
		}
	}
	return "", false
}

// Wrap returns h recording, after each success, the position of the job's db that h vouched
// for (Vouch): h acted on every change up to it. That is a _changes last_seq, read after the
// job began, so a write that lands while h runs is either before it (and acted on) or after
// it (and the record, which the sweep compares with the db's update_seq by couch.Covers, says
// the db is due). No request of the recorder's own: the feed's end is read by the handler
// anyway. When h vouched nothing and said the db is Settled, the db's update_seq is read after
// h and recorded. Nothing is recorded after a failure, a postponement (worker.RetryAfter), a
// missing db (nothing vouched), or once the job's lease is lost (a holder that cannot renew has
// no side effects); a failed put or read is logged, and the job still succeeds: the next sweep
// runs the db once more.
func (r *Recorder) Wrap(h worker.Handler) worker.Handler {
	return func(ctx context.Context, job *worker.Job) error {
		v := &vouchers{}
		err := h(context.WithValue(ctx, vouchKey{}, v), job)
		if err != nil || ctx.Err() != nil || !job.Held() {
			return err
		}
		v.mu.Lock()
		seqs, settled := v.seqs, v.settled
		v.mu.Unlock()
		log := r.log.WithField("db", job.DB)
		pctx, cancel := context.WithTimeout(ctx, putTimeout)
		defer cancel()
		var seq string
		switch {
		case len(seqs) > 0:
			var ok bool
			if seq, ok = earliest(seqs); !ok {
				log.WithField("seqs", seqs).Debug("the job's rules ended at positions that cannot be ordered: not recorded; the next sweep runs the db once more")
				return nil
			}
		case settled:
			info, ierr := r.dbs.DBInfo(pctx, job.DB)
			if ierr != nil {
				if !errors.Is(ierr, couch.ErrNotFound) {
					log.WithError(ierr).Warn("read the db's update_seq to record the job done failed: the reconciliation sweep runs the db once more")
				}
				return nil
			}
			seq = info.UpdateSeq
		default:
			return nil
		}
		if seq == "" || !job.Held() {
			return nil
		}
		if perr := r.records.Put(pctx, job.Group, job.DB, seq); perr != nil {
			log.WithError(perr).Warn("record the job done failed: the reconciliation sweep runs the db once more")
		}
		return nil
	}
}
