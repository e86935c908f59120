package admin

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestSubjectFilter: a rule's subject template becomes the filter of all its subjects, or none
// when ${db_name} is only part of a token.
func TestSubjectFilter(t *testing.T) {
	t.Parallel()
	for tmpl, want := range map[string]string{
		"spiegel.changes.${db_name}":     "spiegel.changes.*",
		"a.${db_name}.b":                 "a.*.b",
		"fixed.subject":                  "fixed.subject",
		"a.db-${db_name}":                "",
		"spiegel.changes.${db_name}.doc": "spiegel.changes.*.doc",
	} {
		assert.Equal(t, want, subjectFilter(tmpl), tmpl)
	}
}
