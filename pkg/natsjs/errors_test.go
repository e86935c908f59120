package natsjs

import (
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
)

// 10071 is a checked expectation that failed; 10164 a check not made while another write on the
// subject was in flight, to be retried; neither is the other, whatever wraps them.
func TestExpectationErrors(t *testing.T) {
	wrong := fmt.Errorf("publish: %w", &jetstream.APIError{ErrorCode: 10071, Description: "wrong last sequence: 4"})
	busy := fmt.Errorf("publish: %w", &jetstream.APIError{ErrorCode: 10164, Description: "wrong last sequence"})
	other := &jetstream.APIError{ErrorCode: 10077, Description: "maximum messages per subject exceeded"}
	assert.True(t, IsWrongLastSequence(wrong))
	assert.False(t, IsSubjectBusy(wrong))
	assert.True(t, IsSubjectBusy(busy))
	assert.False(t, IsWrongLastSequence(busy), "a check not made is not a lost fence")
	assert.False(t, IsWrongLastSequence(other))
	assert.False(t, IsWrongLastSequence(nil))
	assert.True(t, WrongLastCode(10071))
	assert.False(t, WrongLastCode(10164))
}
