package events

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestEncodeDBName(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"user_42":        "user_42",
		"a/b+c$d(e)-f_g": "a~2Fb~2Bc~24d~28e~29-f_g",
		"_users":         "_users",
		"":               "~",
		"dot.star*gt>":   "dot~2Estar~2Agt~3E",
		"~":              "~7E",
		"space tab\t":    "space~20tab~09",
		"Ünïcode":        "~C3~9Cn~C3~AFcode",
	}
	for in, want := range cases {
		t.Run(in, func(t *testing.T) {
			t.Parallel()
			got := EncodeDBName(in)
			assert.Equal(t, want, got)
			back, err := DecodeDBName(got)
			require.NoError(t, err)
			assert.Equal(t, in, back)
		})
	}
}

func TestDecodeDBNameRejects(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"", "a.b", "a*", ">", "a b", "~2", "~zz", "~2f", "~61", "a~", "~~"} {
		_, err := DecodeDBName(bad)
		assert.ErrorIs(t, err, ErrBadToken, "token %q", bad)
	}
}

func TestSubjectsRoundTrip(t *testing.T) {
	t.Parallel()
	s := NewSubjects("")
	subj := s.Work(GroupOnChange, "a/b+c$d(e)-f_g")
	assert.Equal(t, "spiegel.work.onchange.a~2Fb~2Bc~24d~28e~29-f_g", subj)
	g, db, err := s.ParseWork(subj)
	require.NoError(t, err)
	assert.Equal(t, GroupOnChange, g)
	assert.Equal(t, "a/b+c$d(e)-f_g", db)
	assert.Equal(t, "SPIEGEL_WORK", s.WorkStream())
	assert.Equal(t, "replicator", GroupReplicate.ConsumerName())
	_, _, err = s.ParseWork("other.work.x.y")
	assert.Error(t, err)
}

// validToken reports whether tok is one valid NATS subject token.
func validToken(tok string) bool {
	if tok == "" {
		return false
	}
	for i := 0; i < len(tok); i++ {
		c := tok[i]
		if c <= ' ' || c == '.' || c == '*' || c == '>' || c >= 0x7f {
			return false
		}
	}
	return true
}

func FuzzDBNameToken(f *testing.F) {
	for _, s := range []string{"", "user_1", "a/b+c$d(e)-f_g", "~", "~7E", ".", "*>", "\x00", "é"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		tok := EncodeDBName(name)
		if !validToken(tok) {
			t.Fatalf("EncodeDBName(%q) = %q is not a single valid token", name, tok)
		}
		back, err := DecodeDBName(tok)
		if err != nil || back != name {
			t.Fatalf("round trip %q → %q → %q, %v", name, tok, back, err)
		}
		// Decoding arbitrary input never panics, and what decodes re-encodes to itself.
		if dec, err := DecodeDBName(name); err == nil {
			if EncodeDBName(dec) != name {
				t.Fatalf("token %q decodes to %q which encodes to %q", name, dec, EncodeDBName(dec))
			}
		}
		_ = utf8.ValidString(name)
		_ = strings.ToLower(name)
	})
}

func TestChangeMsgIDOn(t *testing.T) {
	t.Parallel()
	s := NewSubjects("")
	assert.Equal(t, "spiegel.changes.a~2Fb", s.ChangeSubject("a/b"))
	assert.Equal(t, "a/b/doc/1-x", s.ChangeMsgIDOn("spiegel.changes.a~2Fb", "a/b", "doc", "1-x"), "the db's own subject: SPEC §3's id")
	assert.Equal(t, "@audit.a~2Fb/a/b/doc/1-x", s.ChangeMsgIDOn("audit.a~2Fb", "a/b", "doc", "1-x"))
	assert.Equal(t, "@spiegel.changes.other/a/b/doc/1-x", s.ChangeMsgIDOn("spiegel.changes.other", "a/b", "doc", "1-x"), "another db's subject")
	assert.Equal(t, "replay/r1/@audit.x/x/doc/1-x", ReplayMsgID("r1", s.ChangeMsgIDOn("audit.x", "x", "doc", "1-x")))
}

// FuzzChangeMsgIDOn: one change published to two subjects gets two ids, the db's own subject
// keeps ChangeMsgID, and an id on another subject is never the own-subject id of any change of a
// db CouchDB accepts (its name starts with a lowercase letter).
func FuzzChangeMsgIDOn(f *testing.F) {
	f.Add("spiegel.changes.db", "other.db", "db", "doc", "1-a")
	f.Add("a.b", "spiegel.changes.db", "db", "x/y", "2-b")
	f.Fuzz(func(t *testing.T, subj1, subj2, db, doc, rev string) {
		s := NewSubjects("")
		id1, id2 := s.ChangeMsgIDOn(subj1, db, doc, rev), s.ChangeMsgIDOn(subj2, db, doc, rev)
		if subj1 != subj2 && id1 == id2 {
			t.Fatalf("subjects %q and %q share the id %q", subj1, subj2, id1)
		}
		if subj1 == s.ChangeSubject(db) && id1 != ChangeMsgID(db, doc, rev) {
			t.Fatalf("own subject %q: id %q", subj1, id1)
		}
		if subj1 != s.ChangeSubject(db) && (id1 == "" || id1[0] != '@') {
			t.Fatalf("other subject %q: id %q could be an own-subject id", subj1, id1)
		}
	})
}
