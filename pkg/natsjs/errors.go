package natsjs

import (
	"errors"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// JetStream's answers to a publish with an expectation (expected last sequence, expected last
// sequence of a subject, a key-value update's revision), told apart in one place:
//
//   - 10071, "wrong last sequence": the expectation was checked and did not hold. Someone else
//     wrote since: for a fence or a compare-and-set, the writer lost.
//   - 10164, "wrong last sequence" without a sequence: the check could not be made because a
//     write on the same subject is in flight (replicated streams; nats-server's
//     expectedPerSubjectInProcess). Nothing was decided: the publish may be sent again, and then
//     either passes or gets 10071.
const (
	errCodeWrongLastSequence = jetstream.JSErrCodeStreamWrongLastSequence // 10071
	errCodeSubjectBusy       = 10164
)

// IsWrongLastSequence reports whether err is JetStream refusing an expectation that was checked
// and did not hold (10071): a fenced writer, a lost compare-and-set.
func IsWrongLastSequence(err error) bool {
	return apiCode(err) == errCodeWrongLastSequence
}

// IsSubjectBusy reports whether err is JetStream declining to check an expectation while
// another write on the same subject is in flight (10164): transient, to be retried.
func IsSubjectBusy(err error) bool {
	return apiCode(err) == errCodeSubjectBusy
}

// WrongLastCode reports whether code, a JetStream API error code read from a raw answer, is
// IsWrongLastSequence's.
func WrongLastCode(code int) bool { return jetstream.ErrorCode(code) == errCodeWrongLastSequence }

func apiCode(err error) jetstream.ErrorCode {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return apiErr.ErrorCode
	}
	return 0
}

// MsgGone reports whether a JetStream API error (code, description) says that the message asked
// for is not there (10037, or a delete's 10057 "no message found"): deleted or expired already.
func MsgGone(code int, description string) bool {
	return code == 10037 || code == 10057 && strings.Contains(description, "no message found")
}
