package reconcile

import (
	"context"
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

// NewRecorder returns a recorder reading db infos from dbs and writing into records.
func NewRecorder(dbs dbInfoReader, records recordPutter, log logrus.FieldLogger) *Recorder {
	return &Recorder{dbs: dbs, records: records, log: log}
}

// startKey carries the db info read before the handler ran (see StartInfo).
type startKey struct{}

type start struct {
	info couch.DBInfo
	err  error
}

// StartInfo returns the info of the job's db that Wrap read before the handler ran, or the
// error of that read; ok is false when the handler does not run under Wrap. A handler that
// needs the db's info before it starts (the replicator's source check) uses it instead of a
// request of its own.
func StartInfo(ctx context.Context) (info couch.DBInfo, ok bool, err error) {
	s, ok := ctx.Value(startKey{}).(start)
	return s.info, ok, s.err
}

// Wrap returns h recording, after each success, the update_seq of the job's db as read before h
// ran (GET /{db}): h saw every change up to it. The read comes first, not beside h's first
// request: a write landing between h's read of the db and a parallel info read would be recorded
// as done without having been processed, and if NATS then lost its wakeup too the sweep would
// not heal it. A failed read does not fail the job: h runs and nothing is recorded (the next
// sweep enqueues the db once more). Nothing is recorded after a failure, a postponement
// (worker.RetryAfter), a missing db, or once the job's lease is lost (a holder that cannot renew
// has no side effects); a failed put is logged, and the job still succeeds.
func (r *Recorder) Wrap(h worker.Handler) worker.Handler {
	return func(ctx context.Context, job *worker.Job) error {
		info, ierr := r.dbs.DBInfo(ctx, job.DB)
		err := h(context.WithValue(ctx, startKey{}, start{info: info, err: ierr}), job)
		if err != nil || ierr != nil || info.UpdateSeq == "" || ctx.Err() != nil || !job.Held() {
			return err
		}
		pctx, cancel := context.WithTimeout(ctx, putTimeout)
		defer cancel()
		if perr := r.records.Put(pctx, job.Group, job.DB, info.UpdateSeq); perr != nil {
			r.log.WithError(perr).WithField("db", job.DB).
				Warn("record the job done failed: the reconciliation sweep runs the db once more")
		}
		return nil
	}
}
