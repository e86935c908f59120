package status

import (
	"sync"
	"time"
	"unicode/utf8"

	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// maxErrorText bounds the error texts a Recorder keeps.
const maxErrorText = 500

// Recorder keeps a consumer process's figures for its Report: per rule, the last run, its result
// and error, and the failures of the last hour; per job result, a count; and the last error. It
// holds only counters and one small ring per rule (60 one-minute buckets), whatever the number
// of runs. Error texts are redacted (logging.RedactText) and cut to 500 bytes; callers still pass
// errors whose URLs carry no password, as they do to logs. Safe for concurrent use; a nil
// *Recorder records nothing.
type Recorder struct {
	now func() time.Time

	mu      sync.Mutex
	rules   map[string]*ruleState
	jobs    map[string]uint64
	lastErr *ErrorNote
}

// ruleState is one rule's figures.
type ruleState struct {
	RuleStats
	minutes [60]minuteCount // failures by minute, indexed by minute % 60
}

type minuteCount struct {
	minute int64 // unix minute the count belongs to
	n      int
}

// NewRecorder returns an empty Recorder.
func NewRecorder() *Recorder {
	return &Recorder{now: time.Now, rules: map[string]*ruleState{}, jobs: map[string]uint64{}}
}

// RuleRun records that rule ran in a db with result (ResultOK, ...); err, for a failure, says
// why (nil otherwise). A failure also becomes the process's last error.
func (r *Recorder) RuleRun(rule, result string, err error) {
	if r == nil {
		return
	}
	now, text := r.now(), errText(err)
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.rule(rule)
	s.LastRun, s.LastResult, s.LastError = now, result, text
	s.Runs++
	if IsFailure(result) {
		r.failure(s, rule, now, text)
	}
}

// GaveUp records a failure of rule that is not a run's result: one request given up (its dead
// letter recorded) in a run that went on. It counts among the rule's failures and becomes the
// process's last error.
func (r *Recorder) GaveUp(rule string, err error) {
	if r == nil {
		return
	}
	now, text := r.now(), errText(err)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failure(r.rule(rule), rule, now, text)
}

// Gap records a gap found in what rule keeps for readers in db (see RuleStats.LastGap).
func (r *Recorder) Gap(rule, db, text string) {
	if r == nil {
		return
	}
	note := &GapNote{At: r.now(), DB: db, Text: redact(text)}
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.rule(rule)
	s.Gaps++
	s.LastGap = note
}

// rule returns the state of rule, made when missing. r.mu is held.
func (r *Recorder) rule(id string) *ruleState {
	s := r.rules[id]
	if s == nil {
		s = &ruleState{}
		r.rules[id] = s
	}
	return s
}

// failure counts a failure of s at now. r.mu is held.
func (r *Recorder) failure(s *ruleState, rule string, now time.Time, text string) {
	s.Failures++
	m := now.Unix() / 60
	b := &s.minutes[m%60]
	if b.minute != m {
		*b = minuteCount{minute: m}
	}
	b.n++
	if text != "" {
		r.lastErr = &ErrorNote{At: now, Rule: rule, Text: text}
	}
}

// Error records err as the process's last error (rule may be "").
func (r *Recorder) Error(rule string, err error) {
	if r == nil || err == nil {
		return
	}
	note := &ErrorNote{At: r.now(), Rule: rule, Text: redact(err.Error())}
	r.mu.Lock()
	r.lastErr = note
	r.mu.Unlock()
}

// JobDone counts a settled job by result (worker.Observer).
func (r *Recorder) JobDone(_ events.Group, result string, _ time.Duration) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.jobs[result]++
	r.mu.Unlock()
}

// Fill sets rep's Jobs, LastError and RuleStats from what was recorded.
func (r *Recorder) Fill(rep *Report) {
	if r == nil {
		return
	}
	now := r.now().Unix() / 60
	r.mu.Lock()
	defer r.mu.Unlock()
	rep.Jobs = make(map[string]uint64, len(r.jobs))
	for k, v := range r.jobs {
		rep.Jobs[k] = v
	}
	if r.lastErr != nil {
		e := *r.lastErr
		rep.LastError = &e
	}
	rep.RuleStats = make(map[string]RuleStats, len(r.rules))
	for id, s := range r.rules {
		st := s.RuleStats
		for _, b := range s.minutes {
			if b.minute > now-60 && b.minute <= now {
				st.FailuresLastHour += b.n
			}
		}
		rep.RuleStats[id] = st
	}
}

// redact makes an error text fit for a status answer.
func redact(s string) string {
	s = logging.RedactText(s)
	if len(s) > maxErrorText {
		cut := maxErrorText
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}

// errText is err's text without secrets ("" for nil).
func errText(err error) string {
	if err == nil {
		return ""
	}
	return redact(err.Error())
}
