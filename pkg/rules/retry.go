package rules

import (
	"math"
	"sort"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/mango"
)

// Backoff kinds of a RetryPolicy.
const (
	BackoffLinear      = "linear"
	BackoffExponential = "exponential"
)

// Defaults of a rule's "retry" field.
const (
	DefaultRetryDelay      = time.Second
	DefaultRetryMultiplier = 2.0
	DefaultRetryLimit      = 10
	DefaultRetryMaxDelay   = 10 * time.Minute
)

// RetryPolicy says how an on_change rule retries a failed request. Rule field "retry", all keys
// optional: {"backoff": "linear"|"exponential", "delay_ms": 1000, "multiplier": 2, "limit": 10,
// "max_delay_ms": 600000}.
//
// Limit is the number of retries after the first failed attempt (default DefaultRetryLimit);
// 0 means retry forever. After the last retry fails the request goes to the dead-letter subject.
type RetryPolicy struct {
	Backoff    string        // BackoffLinear or BackoffExponential (default)
	BaseDelay  time.Duration // "delay_ms": the first retry's delay (default 1s)
	Multiplier float64       // "multiplier" (≥ 1), exponential only (default 2)
	Limit      int           // "limit": retries after the first attempt; 0 = forever
	MaxDelay   time.Duration // "max_delay_ms": cap of any delay (default 10 min)
}

// DefaultRetryPolicy is the policy of a rule without a "retry" field.
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{
		Backoff:    BackoffExponential,
		BaseDelay:  DefaultRetryDelay,
		Multiplier: DefaultRetryMultiplier,
		Limit:      DefaultRetryLimit,
		MaxDelay:   DefaultRetryMaxDelay,
	}
}

// Delay returns the wait before retry number attempt (1 for the first retry; smaller values
// count as 1): linear gives BaseDelay × attempt, exponential BaseDelay × Multiplier^(attempt-1);
// both are capped at MaxDelay (when MaxDelay > 0). No jitter: callers add their own.
func (p RetryPolicy) Delay(attempt int) time.Duration {
	if attempt < 1 {
		attempt = 1
	}
	var d float64
	if p.Backoff == BackoffLinear {
		d = float64(p.BaseDelay) * float64(attempt)
	} else {
		mult := p.Multiplier
		if mult < 1 {
			mult = 1
		}
		d = float64(p.BaseDelay) * math.Pow(mult, float64(attempt-1))
	}
	if p.MaxDelay > 0 && !(d <= float64(p.MaxDelay)) { // NaN included
		return p.MaxDelay
	}
	if !(d < float64(math.MaxInt64)) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(d)
}

// GiveUp reports whether a request that has already been retried `retries` times must not be
// retried again.
func (p RetryPolicy) GiveUp(retries int) bool {
	return p.Limit > 0 && retries >= p.Limit
}

func parseRetry(f fields) (RetryPolicy, error) {
	p := DefaultRetryPolicy()
	v, ok := f.doc["retry"]
	if !ok || v == nil {
		return p, nil
	}
	obj, ok := v.(map[string]any)
	if !ok {
		return p, f.errorf("retry", "must be an object")
	}
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys) // report the first bad key deterministically
	var err error
	for _, k := range keys {
		x := obj[k]
		field := "retry." + k
		switch k {
		case "backoff":
			s, _ := x.(string)
			if s != BackoffLinear && s != BackoffExponential {
				return p, f.errorf(field, "must be %q or %q", BackoffLinear, BackoffExponential)
			}
			p.Backoff = s
		case "delay_ms":
			if p.BaseDelay, err = millisValue(f, field, x, DefaultRetryDelay); err != nil {
				return p, err
			}
		case "max_delay_ms":
			if p.MaxDelay, err = millisValue(f, field, x, DefaultRetryMaxDelay); err != nil {
				return p, err
			}
		case "multiplier":
			m, ok := mango.Number(x)
			if !ok || m < 1 || math.IsInf(m, 0) || math.IsNaN(m) {
				return p, f.errorf(field, "must be a number ≥ 1")
			}
			p.Multiplier = m
		case "limit":
			n, ok := mango.Number(x)
			if !ok || n < 0 || n != math.Trunc(n) || n > math.MaxInt32 {
				return p, f.errorf(field, "must be a non-negative integer (0 = forever)")
			}
			p.Limit = int(n)
		default:
			return p, f.errorf(field, "unknown key (want backoff, delay_ms, multiplier, limit, max_delay_ms)")
		}
	}
	return p, nil
}
