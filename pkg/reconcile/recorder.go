package reconcile

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/worker"
)

// putTimeout bounds the put of one completion record.
const putTimeout = 5 * time.Second

// dbReader reads a db's info, and whether the db changed after a seq (*couch.Client).
type dbReader interface {
	DBInfo(ctx context.Context, db string) (couch.DBInfo, error)
	ChangedSince(ctx context.Context, db, since string) (bool, error)
}

// recordPutter writes completion records (*Records).
type recordPutter interface {
	PutFor(ctx context.Context, g events.Group, db, seq, rules string) error
}

// Recorder writes the completion record of every successful job of a consumer (see Wrap).
type Recorder struct {
	dbs     dbReader
	records recordPutter
	log     logrus.FieldLogger
	// Rules returns the fingerprint of the group's rules that match a db (rules.Set.Fingerprint),
	// recorded with the seq (nil: none).
	Rules func(g events.Group, db string) string
}

// NewRecorder returns a recorder writing into records; dbs serves the read after a Settled job
// and the questions about parts that ended at different seqs (earliest).
func NewRecorder(dbs dbReader, records recordPutter, log logrus.FieldLogger) *Recorder {
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
// part of the job that got there (each rule); after a success the recorder records a position
// every part has passed (see earliest; when it cannot tell one, nothing is recorded). Outside
// Wrap it does nothing.
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

// earliest returns a seq of seqs, the ends of the job's parts, that no part has acted past: a
// record there is never later than what a part did (which would lose its changes), at worst
// earlier (which costs the db one job more at the next sweep). Seqs are opaque, so it does not
// order them:
//   - all the same string: that seq;
//   - else CouchDB is asked, once per distinct seq, whether db changed after it
//     (ChangedSince, one _changes row). A part with no change after its seq had acted on all of
//     db as it was at the question, after every part's read ended: any seq of another part is
//     as early. So when at most one seq has changes after it, that one (else the first) is
//     recorded. Two or more with changes after them cannot be ordered, and a failed question
//     cannot tell: false, nothing is recorded.
//
// False for no seqs.
func (r *Recorder) earliest(ctx context.Context, db string, seqs []string) (string, bool) {
	var distinct []string
	for _, s := range seqs {
		if !slices.Contains(distinct, s) {
			distinct = append(distinct, s)
		}
	}
	switch len(distinct) {
	case 0:
		return "", false
	case 1:
		return distinct[0], true
	}
	behind := ""
	for _, s := range distinct {
		changed, err := r.dbs.ChangedSince(ctx, db, s)
		switch {
		case err != nil:
			return "", false
		case changed && behind != "":
			return "", false
		case changed:
			behind = s
		}
	}
	return cmp.Or(behind, distinct[0]), true
}

// Wrap returns h recording, after each success, the position of the job's db that h vouched
// for (Vouch): h acted on every change up to it. That is a _changes last_seq, read after the
// job began, so a write that lands while h runs is either before it (and acted on) or after
// it (and the record, which the sweep compares with the db's update_seq and then asks CouchDB
// about, says the db is due). No request of the recorder's own when the parts vouched for one
// seq (the feed's end is read by the handler anyway); one per distinct seq otherwise (earliest). When h vouched nothing and said the db is Settled, the db's update_seq is read after
// h and recorded. Nothing is recorded after a failure, a postponement (worker.RetryAfter), a
// missing db (nothing vouched), or once the job's lease is lost (a holder that cannot renew has
// no side effects); a failed put or read is logged, and the job still succeeds: the next sweep
// runs the db once more.
func (r *Recorder) Wrap(h worker.Handler) worker.Handler {
	return func(ctx context.Context, job *worker.Job) error {
		var rules string
		if r.Rules != nil {
			rules = r.Rules(job.Group, job.DB) // the rules the job starts with: a later edit leaves the record due
		}
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
			if seq, ok = r.earliest(pctx, job.DB, seqs); !ok {
				log.WithField("seqs", seqs).Debug("the job's rules ended at positions CouchDB cannot order for us: not recorded; the next sweep runs the db once more")
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
		if perr := r.records.PutFor(pctx, job.Group, job.DB, seq, rules); perr != nil {
			log.WithError(perr).Warn("record the job done failed: the reconciliation sweep runs the db once more")
		}
		return nil
	}
}
