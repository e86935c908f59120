package webhook

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// Retry says how Deliver and Retrying retry a failed action.
type Retry struct {
	// Policy is the rule's backoff and limit (Limit 0 = retry forever).
	Policy rules.RetryPolicy
	// Done is the number of attempts already made by earlier calls (a job that deferred the
	// request and runs again); attempts and the limit count from there.
	Done int
	// InlineMax is the longest retry delay waited for inside the call. A retry due later is not
	// waited for: the call returns with Outcome.RetryIn set, so that the caller can free its
	// resources and come back. 0 waits for every retry.
	InlineMax time.Duration
}

// Outcome is the result of Deliver or Retrying. Exactly one holds:
//   - Err == nil: the action succeeded;
//   - GaveUp: it failed permanently or the retry limit is reached; Err is the last error;
//   - RetryIn > 0: the next retry is due after RetryIn (longer than Retry.InlineMax);
//   - otherwise ctx ended while waiting or sending; Err is the last error.
type Outcome struct {
	Attempts int   // attempts made in all, Retry.Done included
	Status   int   // HTTP status of the last attempt, 0 when there was no answer
	Err      error // nil on success
	GaveUp   bool
	RetryIn  time.Duration
}

// Attempt is one try of an action: the HTTP status (0 when none applies) and nil on success.
// An error for which IsPermanent holds is not retried.
type Attempt func(ctx context.Context) (status int, err error)

// Retrying runs try until it succeeds, fails permanently, reaches the retry limit, needs a wait
// longer than r.InlineMax, or ctx ends. Retry n (1 for the first) waits r.Policy.Delay(n) plus up
// to 10% jitter; a wait ends early when ctx ends.
func Retrying(ctx context.Context, r Retry, try Attempt) Outcome {
	out := Outcome{Attempts: r.Done}
	for {
		out.Attempts++
		out.Status, out.Err = try(ctx)
		if out.Err == nil {
			return out
		}
		if ctx.Err() != nil {
			return out // interrupted: never counts as giving up
		}
		if IsPermanent(out.Err) || r.Policy.GiveUp(out.Attempts-1) {
			out.GaveUp = true
			return out
		}
		delay := r.Policy.Delay(out.Attempts)
		delay += time.Duration(rand.Int64N(int64(delay)/10 + 1))
		if r.InlineMax > 0 && delay > r.InlineMax {
			out.RetryIn = delay
			return out
		}
		if backoff.Sleep(ctx, delay) != nil {
			return out
		}
	}
}

// Deliver sends req with retries (see Retrying). On success Outcome.Status is the 2xx status.
func (c *Client) Deliver(ctx context.Context, req Request, r Retry) Outcome {
	return Retrying(ctx, r, func(ctx context.Context) (int, error) { return c.Send(ctx, req) })
}
