package rules

import (
	"fmt"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Policy is what the installation allows rules beyond their own syntax. The zero value is the
// default installation: subject prefix events.DefaultPrefix, no operator list of subjects.
type Policy struct {
	// SubjectPrefix is SPIEGEL_SUBJECT_PREFIX ("" means events.DefaultPrefix). The service's own
	// subjects live under it (work, wakeup, dead letters, status); of those, subject rules may
	// only publish under <prefix>.changes.
	SubjectPrefix string
	// AllowedSubjects is SPIEGEL_PUBLISH_ALLOWED_SUBJECTS: when not empty, subject rules may only
	// publish to subjects that one of these filters (NATS wildcards * and >) matches for every
	// db name.
	AllowedSubjects []string
}

// subjectToken is one token of a subject template: literal text, or text holding a
// substitution token (variable), which stands for any token (a db name makes it).
type subjectToken struct {
	text     string // the literal token (variable: with \x00 where a substitution stands)
	lead     string // the literal text before the first substitution
	variable bool
}

// templateTokens splits a subject template into its tokens. Substitution tokens are replaced
// first, as one token may hold a dot ("${change.id}").
func templateTokens(subject string) []subjectToken {
	var b strings.Builder
	for i := 0; i < len(subject); {
		if _, n, ok := matchToken(subject, i, true); ok {
			b.WriteByte(0)
			i += n
			continue
		}
		b.WriteByte(subject[i])
		i++
	}
	var out []subjectToken
	for _, tok := range strings.Split(b.String(), ".") {
		t := subjectToken{text: tok, lead: tok}
		if i := strings.IndexByte(tok, 0); i >= 0 {
			t.variable, t.lead = true, tok[:i]
		}
		out = append(out, t)
	}
	return out
}

// checkSubjectSpace refuses a subject template that could publish, for some db name, outside
// the space open to rules: NATS' own subjects ($JS, $SYS, $KV, $O, ... — every subject whose
// first token starts with '$'), reply subjects (_INBOX.>), the service's own subjects under the
// prefix other than <prefix>.changes.>, and, when the operator listed allowed subjects, anything
// they do not cover. A substitution token counts as "any token" (a db name fills it), so a
// template is refused when some db name would take it there.
func (p Policy) checkSubjectSpace(subject string) error {
	toks := templateTokens(subject)
	if len(toks) == 0 {
		return errString("not a valid NATS subject: empty")
	}
	first := toks[0]
	if strings.HasPrefix(first.lead, "$") {
		return fmt.Errorf("%q is a NATS system subject (subjects starting with $, such as $JS, $SYS, $KV, $O): rules never publish there", subject)
	}
	if first.variable && strings.HasPrefix("_INBOX", first.lead) || !first.variable && first.text == "_INBOX" {
		return fmt.Errorf("%q could be a reply subject (_INBOX.>) or another installation's subject: the first token must be literal text and not _INBOX", subject)
	}
	prefix := strings.Split(events.NewSubjects(p.SubjectPrefix).Prefix, ".")
	if overlaps(toks, prefix) && !under(toks, append(prefix, "changes")) {
		return fmt.Errorf("%q could publish into the service's own subjects %s.> (work, wakeup, dead letters, status): rules may only publish under %s.changes. there",
			subject, strings.Join(prefix, "."), strings.Join(prefix, "."))
	}
	if len(p.AllowedSubjects) > 0 {
		for _, f := range p.AllowedSubjects {
			if f = strings.TrimSpace(f); f != "" && covered(toks, strings.Split(f, ".")) {
				return nil
			}
		}
		return fmt.Errorf("%q is outside the subjects the operator allows (SPIEGEL_PUBLISH_ALLOWED_SUBJECTS: %s)", subject, strings.Join(p.AllowedSubjects, ","))
	}
	return nil
}

// overlaps reports whether some subject the template makes starts with the tokens of prefix and
// has at least one more token (the template could publish under prefix.>).
func overlaps(toks []subjectToken, prefix []string) bool {
	if len(toks) <= len(prefix) {
		return false
	}
	for i, p := range prefix {
		if !toks[i].variable && toks[i].text != p {
			return false
		}
		if toks[i].variable && !strings.HasPrefix(p, toks[i].lead) {
			return false
		}
	}
	return true
}

// under reports whether every subject the template makes is under prefix.> (literal tokens
// equal to prefix, then at least one more).
func under(toks []subjectToken, prefix []string) bool {
	if len(toks) <= len(prefix) {
		return false
	}
	for i, p := range prefix {
		if toks[i].variable || toks[i].text != p {
			return false
		}
	}
	return true
}

// covered reports whether the filter (NATS wildcards) matches every subject the template makes.
func covered(toks []subjectToken, filter []string) bool {
	for i, f := range filter {
		switch {
		case f == ">":
			return i < len(toks)
		case i >= len(toks):
			return false
		case f == "*":
		case toks[i].variable || toks[i].text != f:
			return false
		}
	}
	return len(toks) == len(filter)
}
