package worker

import (
	"errors"
	"fmt"
	"time"
)

// permanentError marks a failure that no retry can fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as a failure that retrying cannot fix: the runner publishes a dead-letter
// record and terminates the job, so that it is not delivered again (the db runs again on its
// next change). errors.Is and errors.As still see err. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or an error it wraps, was marked with Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// retryAfterError asks for a redelivery after a fixed delay.
type retryAfterError struct {
	delay time.Duration
	err   error
}

func (e *retryAfterError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("retry after %s", e.delay)
	}
	return fmt.Sprintf("retry after %s: %s", e.delay, e.err)
}

func (e *retryAfterError) Unwrap() error { return e.err }

// RetryAfter asks the runner to deliver the job again after exactly d (NakWithDelay(d)) instead
// of its backoff. err may be nil, meaning "not a failure, just later" (e.g. a rule's
// dirty_after_milliseconds on the first delivery): such a job is logged at debug level and
// reported as "delayed", not as a failure.
func RetryAfter(d time.Duration, err error) error {
	if d < 0 {
		d = 0
	}
	return &retryAfterError{delay: d, err: err}
}

// asRetryAfter returns the RetryAfter request in err's chain, if any.
func asRetryAfter(err error) (*retryAfterError, bool) {
	var r *retryAfterError
	ok := errors.As(err, &r)
	return r, ok
}
