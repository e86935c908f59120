package rules

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

func subjectRule(subject string) []byte {
	return []byte(`{"type":"on_change","subject":"` + subject + `"}`)
}

// TestSubjectSpace: subject rules never publish into NATS' own subjects, reply subjects or the
// service's own subjects (work queue, wakeups, dead letters, status), for any db name; the
// operator's list narrows what is left.
func TestSubjectSpace(t *testing.T) {
	t.Parallel()
	cases := []struct {
		subject string
		policy  Policy
		reason  string // "" = accepted
	}{
		{"spiegel.changes.${db_name}", Policy{}, ""},
		{"couch.changes.${db_name}", Policy{}, ""},
		{"orders.${db_name}.created", Policy{}, ""},
		{"x${db_name}.y", Policy{}, ""},
		{"spiegel.changes.${change.id}", Policy{}, ""},
		{"spiegel.${change.id}.x", Policy{}, "service's own subjects"},
		{"$JS.API.STREAM.DELETE.SPIEGEL_WORK", Policy{}, "NATS system subject"},
		{"$SYS.REQ.SERVER.PING", Policy{}, "NATS system subject"},
		{"$KV.SPIEGEL_ONCHANGE.${db_name}", Policy{}, "NATS system subject"},
		{"$O.store.${db_name}", Policy{}, "NATS system subject"},
		{"$JS.ACK.SPIEGEL_WORK.x", Policy{}, "NATS system subject"},
		{"$${db_name}.x", Policy{}, "NATS system subject"},
		{"_INBOX.abc", Policy{}, "_INBOX"},
		{"${db_name}.changes", Policy{}, "first token must be literal"},
		{"_${db_name}.x", Policy{}, "first token must be literal"},
		{"spiegel.work.onchange.${db_name}", Policy{}, "service's own subjects spiegel.>"},
		{"spiegel.wakeup.onchange.x", Policy{}, "service's own subjects"},
		{"spiegel.deadletter.onchange.${db_name}", Policy{}, "service's own subjects"},
		{"spiegel.svc.onchange.status", Policy{}, "service's own subjects"},
		{"spiegel.${db_name}.x", Policy{}, "service's own subjects"},      // db "work" would make a work subject
		{"spiegel.changes", Policy{}, "service's own subjects"},           // not under spiegel.changes.>
		{"spiegel.work.x", Policy{SubjectPrefix: "acme.sp"}, ""},          // another prefix: an ordinary subject
		{"acme.sp.work.x", Policy{SubjectPrefix: "acme.sp"}, "acme.sp.>"}, // a two-token prefix
		{"acme.${db_name}.work.x", Policy{SubjectPrefix: "acme.sp"}, "acme.sp.>"},
		{"acme.sp.changes.${db_name}", Policy{SubjectPrefix: "acme.sp"}, ""},
		{"orders.${db_name}", Policy{AllowedSubjects: []string{"orders.>"}}, ""},
		{"orders.eu.${db_name}", Policy{AllowedSubjects: []string{"orders.*.*", "x.>"}}, ""},
		{"orders.${db_name}", Policy{AllowedSubjects: []string{"orders.eu"}}, "outside the subjects the operator allows"},
		{"orders.${db_name}.x", Policy{AllowedSubjects: []string{"orders.eu.x"}}, "outside"}, // a db name fills the token
		{"orders", Policy{AllowedSubjects: []string{"orders.>"}}, "outside"},
		{"$JS.API.INFO", Policy{AllowedSubjects: []string{">"}}, "NATS system subject"}, // the list never opens reserved space
		{"spiegel.work.x", Policy{AllowedSubjects: []string{">"}}, "service's own subjects"},
	}
	for _, tc := range cases {
		t.Run(tc.subject, func(t *testing.T) {
			t.Parallel()
			_, err := ParseWith("r", subjectRule(tc.subject), tc.policy)
			if tc.reason == "" {
				require.NoError(t, err)
				return
			}
			var ve *ValidationError
			require.True(t, errors.As(err, &ve), "want a ValidationError, got %v", err)
			assert.Equal(t, "subject", ve.Field)
			assert.Contains(t, err.Error(), tc.reason)
		})
	}
}

// TestSetUsesPolicy: a Set made with a policy rejects what the policy refuses, at load.
func TestSetUsesPolicy(t *testing.T) {
	t.Parallel()
	s := NewSetWith(Policy{SubjectPrefix: "acme"})
	_, err := s.Apply("r1", subjectRule("acme.work.onchange.x"), false)
	require.Error(t, err)
	_, err = s.Apply("r2", subjectRule("spiegel.work.onchange.x"), false)
	require.NoError(t, err)
	assert.Equal(t, 1, s.Stats().Rejected)
}

// reservedSubject is the plain statement of what no rule may publish to, for one concrete
// subject under the default prefix.
func reservedSubject(s string) bool {
	return strings.HasPrefix(s, "$") || s == "_INBOX" || strings.HasPrefix(s, "_INBOX.") ||
		strings.HasPrefix(s, "spiegel.") && !strings.HasPrefix(s, "spiegel.changes.")
}

// FuzzSubjectSpace: whenever a template is accepted, no db name makes it a reserved subject.
func FuzzSubjectSpace(f *testing.F) {
	f.Add("spiegel.changes.${db_name}", "work")
	f.Add("spiegel.${db_name}.x", "work")
	f.Add("${db_name}.x", "spiegel")
	f.Add("x$db_name.y", "_INBOX")
	f.Add("a.b", "")
	f.Add("spiegel.${change.id}", "x")
	f.Fuzz(func(t *testing.T, subject, db string) {
		if _, err := Parse("r", subjectRule(strings.NewReplacer(`"`, "", `\`, "").Replace(subject))); err != nil {
			return
		}
		subject = strings.NewReplacer(`"`, "", `\`, "").Replace(subject)
		for _, name := range []string{db, "spiegel", "work", "_INBOX", "$JS"} {
			got := Interpolate(subject, Vars{DBName: events.EncodeDBName(name)}, false)
			if reservedSubject(got) {
				t.Fatalf("template %q accepted, but db %q makes %q", subject, name, got)
			}
		}
	})
}
