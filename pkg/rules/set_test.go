package rules

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

func ruleIDs[R Rule](rs []R) []string {
	out := []string{}
	for _, r := range rs {
		out = append(out, r.ID())
	}
	return out
}

func TestSetApply(t *testing.T) {
	t.Parallel()
	s := NewSet()
	g0 := s.Generation()

	ch, err := s.Apply("rep", []byte(`{"_rev":"1-a","type":"replicator","source":"db1","target":"http://u@h/db1"}`), false)
	require.NoError(t, err)
	require.NotNil(t, ch.Added)
	assert.Nil(t, ch.Removed)
	assert.Greater(t, s.Generation(), g0)
	assert.True(t, s.Groups("db1").Has(events.GroupReplicate))
	assert.False(t, s.Groups("db1").Has(events.GroupOnChange))
	assert.Equal(t, []events.Group{events.GroupReplicate}, s.Groups("db1").Groups())
	assert.Zero(t, s.Groups("db2"))

	// The same revision again changes nothing.
	g1 := s.Generation()
	ch, err = s.Apply("rep", []byte(`{"_rev":"1-a","type":"replicator","source":"db1","target":"x"}`), false)
	require.NoError(t, err)
	assert.Equal(t, Change{}, ch)
	assert.Equal(t, g1, s.Generation())

	// Edit: now a pattern rule; the cached answer for db1 must not survive.
	ch, err = s.Apply("rep", []byte(`{"_rev":"2-b","type":"replicator","db_name":"^user_","source":"$db_name","target":"b"}`), false)
	require.NoError(t, err)
	assert.Equal(t, "1-a", ch.Removed.Rev())
	assert.Equal(t, "2-b", ch.Added.Rev())
	assert.Zero(t, s.Groups("db1"))
	assert.True(t, s.Groups("user_1").Has(events.GroupReplicate))
	assert.Equal(t, []string{"rep"}, ruleIDs(s.Replicators("user_1")))

	// An on_change for every db.
	_, err = s.Apply("oc", []byte(`{"type":"on_change","url":"http://h/x"}`), false)
	require.NoError(t, err)
	assert.Equal(t, MaskReplicate|MaskOnChange, s.Groups("user_1"))
	assert.Equal(t, MaskOnChange, s.Groups("db1"))
	assert.Equal(t, []string{"oc"}, ruleIDs(s.OnChanges("db1")))

	// Invalid replaces valid: the old rule is gone, the id is rejected, the error returned.
	ch, err = s.Apply("rep", []byte(`{"_rev":"3-c","type":"replicator","db_name":"(","source":"a","target":"b"}`), false)
	var ve *ValidationError
	require.True(t, errors.As(err, &ve))
	assert.Equal(t, "db_name", ve.Field)
	assert.Equal(t, "2-b", ch.Removed.Rev())
	assert.Nil(t, ch.Added)
	assert.Equal(t, MaskOnChange, s.Groups("user_1"))
	_, ok := s.Rule("rep")
	assert.False(t, ok)
	st := s.Stats()
	assert.Equal(t, 1, st.Rejected)
	assert.Equal(t, uint64(1), st.RejectedTotal)
	assert.Contains(t, st.RejectedIDs["rep"], "db_name")
	assert.Equal(t, 1, st.OnChanges)

	// Fixed again: no longer rejected.
	_, err = s.Apply("rep", []byte(`{"_rev":"4-d","type":"replicator","source":"db1","target":"b","disabled":true}`), false)
	require.NoError(t, err)
	st = s.Stats()
	assert.Equal(t, Stats{Replicators: 0, OnChanges: 1, Disabled: 1, Rejected: 0, RejectedTotal: 1, RejectedIDs: map[string]string{}}, st)
	assert.Equal(t, MaskOnChange, s.Groups("db1"), "disabled rules do not match")
	assert.Empty(t, s.Replicators("db1"))
	r, ok := s.Rule("rep")
	require.True(t, ok)
	assert.False(t, r.Enabled())

	// Non-rule docs are ignored; a rule doc that stops being a rule is removed.
	ch, err = s.Apply("_design/x", []byte(`{}`), false)
	require.NoError(t, err)
	assert.Equal(t, Change{}, ch)
	ch, err = s.Apply("oc", []byte(`{"type":"note"}`), false)
	require.NoError(t, err)
	assert.Equal(t, "oc", ch.Removed.ID())
	assert.Zero(t, s.Groups("db1"))

	// Delete.
	ch, err = s.Apply("rep", nil, true)
	require.NoError(t, err)
	assert.Equal(t, "rep", ch.Removed.ID())
	ch, err = s.Apply("rep", nil, true)
	require.NoError(t, err)
	assert.Equal(t, Change{}, ch)
	assert.Empty(t, s.All())
}

func TestSetRejectedRedacted(t *testing.T) {
	t.Parallel()
	s := NewSet()
	_, err := s.Apply("bad", []byte(`{"type":"on_change","url":"http://u:hunter2@h/x"}`), false)
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "hunter2")
	assert.NotContains(t, s.Stats().RejectedIDs["bad"], "hunter2")
}

// TestGroupsOracle checks Groups, Replicators and OnChanges against a brute-force evaluation of
// every rule, across random rule sets, edits and db names.
func TestGroupsOracle(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "b", "user", "_", "x", "1", "é", "/", "+", "us", "er", "ab"}
	name := func() string {
		var b strings.Builder
		for n := rng.IntN(5); n >= 0; n-- {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		return b.String()
	}
	patterns := func() string {
		choices := []func() string{
			func() string { return "^" + regexp.QuoteMeta(name()) },
			func() string { return regexp.QuoteMeta(name()) },
			func() string { return "^" + regexp.QuoteMeta(name()) + "$" },
			func() string { return "(?i)^" + regexp.QuoteMeta(name()) },
			func() string { return "^(" + regexp.QuoteMeta(name()) + ")[0-9]*" + regexp.QuoteMeta(name()) },
			func() string { return "[ab]+" + regexp.QuoteMeta(name()) + "x?" + regexp.QuoteMeta(name()) },
			func() string { return "^" + regexp.QuoteMeta(name()) + "|" + regexp.QuoteMeta(name()) + "$" },
			func() string { return "(?m)^" + regexp.QuoteMeta(name()) },
			func() string { return `\A` + regexp.QuoteMeta(name()) + `.*` },
			func() string { return "" },
		}
		return choices[rng.IntN(len(choices))]()
	}
	ruleDoc := func() string {
		disabled := rng.IntN(5) == 0
		if rng.IntN(2) == 0 {
			if rng.IntN(2) == 0 {
				return fmt.Sprintf(`{"type":"replicator","source":%q,"target":"t","disabled":%v}`, "http://h/"+escapeComponent(name()), disabled)
			}
			return fmt.Sprintf(`{"type":"replicator","db_name":%q,"source":"$db_name","target":"t","disabled":%v}`, patterns(), disabled)
		}
		if rng.IntN(6) == 0 {
			return fmt.Sprintf(`{"type":"on_change","url":"http://h/x","disabled":%v}`, disabled)
		}
		return fmt.Sprintf(`{"type":"on_change","db_name":%q,"url":"http://h/x","disabled":%v}`, patterns(), disabled)
	}
	rounds := 8
	if testing.Short() {
		rounds = 2
	}
	for round := 0; round < rounds; round++ {
		s := NewSet()
		for step := 0; step < 300; step++ {
			id := fmt.Sprintf("r%d", rng.IntN(60))
			if rng.IntN(6) == 0 {
				_, err := s.Apply(id, nil, true)
				require.NoError(t, err)
			} else {
				_, err := s.Apply(id, []byte(ruleDoc()), false)
				require.NoError(t, err)
			}
			all := s.All()
			for q := 0; q < 10; q++ {
				db := name()
				var want GroupMask
				var wantRep, wantOC []string
				for _, r := range all {
					if !r.Enabled() || !r.MatchesDB(db) {
						continue
					}
					want |= maskOf(r.Group())
					if r.Kind() == KindReplicator {
						wantRep = append(wantRep, r.ID())
					} else {
						wantOC = append(wantOC, r.ID())
					}
				}
				require.Equal(t, want, s.Groups(db), "db %q round %d step %d", db, round, step)
				require.Equal(t, want, s.Groups(db), "cached, db %q", db)
				require.Equal(t, append([]string{}, wantRep...), ruleIDs(s.Replicators(db)), "db %q", db)
				require.Equal(t, append([]string{}, wantOC...), ruleIDs(s.OnChanges(db)), "db %q", db)
			}
		}
	}
}

func TestRequiredLiterals(t *testing.T) {
	t.Parallel()
	for src, want := range map[string][2]string{
		"^user_":         {"user_", ""},
		`\Auser_\d+$`:    {"user_", ""},
		"^(user)_x":      {"user_x", ""},
		"^(?:ab|ac)":     {"a", ""},
		"^ab|^ac":        {"", ""},
		"user_":          {"", "user_"},
		"[a-z]+_tenant":  {"", "_tenant"},
		"^[a-z]+_tenant": {"", "_tenant"},
		"(?i)^user":      {"", ""},
		"(?m)^user":      {"", "user"},
		"^us|er":         {"", ""},
		"ab":             {"", ""},
		"":               {"", ""},
	} {
		p, tri := requiredLiterals(src)
		assert.Equal(t, want, [2]string{p, tri}, src)
	}
}

func TestSetConcurrent(t *testing.T) {
	t.Parallel()
	s := NewSet()
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 500; i++ {
				db := fmt.Sprintf("user_%d", i%50)
				m := s.Groups(db)
				_ = s.Replicators(db)
				_ = s.OnChanges(db)
				_ = s.Stats()
				_ = m.Groups()
			}
		}()
	}
	for i := 0; i < 200; i++ {
		doc := fmt.Sprintf(`{"type":"replicator","db_name":"^user_%d","source":"$db_name","target":"t"}`, i%10)
		_, err := s.Apply(fmt.Sprintf("r%d", i%20), []byte(doc), i%7 == 0)
		require.NoError(t, err)
	}
	wg.Wait()
	// After the writers stop, readers see the final state.
	for i := 0; i < 50; i++ {
		db := fmt.Sprintf("user_%d", i)
		want := GroupMask(0)
		for _, r := range s.All() {
			if r.Enabled() && r.MatchesDB(db) {
				want |= maskOf(r.Group())
			}
		}
		assert.Equal(t, want, s.Groups(db), db)
	}
}

func TestGroupCacheBounded(t *testing.T) {
	t.Parallel()
	s := NewSet()
	s.cacheSize = 100
	_, err := s.Apply("oc", []byte(`{"type":"on_change","db_name":"^a","url":"http://h/x"}`), false)
	require.NoError(t, err)
	for i := 0; i < 1000; i++ {
		assert.Equal(t, MaskOnChange, s.Groups(fmt.Sprintf("a%d", i)))
	}
	assert.LessOrEqual(t, s.cache.Load().n.Load(), int64(101))
}

// A group's fingerprint of a db names its enabled matching rules with their revisions: it moves
// with a rule added, edited or disabled, and not with another group's rules or another db's.
func TestFingerprint(t *testing.T) {
	s := NewSet()
	apply := func(id, doc string) {
		t.Helper()
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(doc), &m))
		m["_id"] = id
		m["_rev"] = fmt.Sprintf("%d-x", len(doc))
		raw, err := json.Marshal(m)
		require.NoError(t, err)
		_, err = s.Apply(id, raw, false)
		require.NoError(t, err)
	}
	assert.Empty(t, s.Fingerprint(events.GroupOnChange, "user_1"), "no rule")
	apply("hook", `{"type":"on_change","db_name":"^user_","url":"https://hooks.example.com/a"}`)
	first := s.Fingerprint(events.GroupOnChange, "user_1")
	assert.Len(t, first, 16)
	assert.Equal(t, first, s.Fingerprint(events.GroupOnChange, "user_2"), "same rules, same fingerprint")
	assert.Empty(t, s.Fingerprint(events.GroupOnChange, "other"), "no matching rule")
	apply("rep", `{"type":"replicator","db_name":"^user_","source":"$db_name","target":"$db_name-copy"}`)
	assert.Equal(t, first, s.Fingerprint(events.GroupOnChange, "user_1"), "another group's rule")
	assert.NotEmpty(t, s.Fingerprint(events.GroupReplicate, "user_1"))
	apply("hook", `{"type":"on_change","db_name":"^user_","url":"https://hooks.example.com/edited"}`)
	assert.NotEqual(t, first, s.Fingerprint(events.GroupOnChange, "user_1"), "an edit (another rev)")
	apply("hook", `{"type":"on_change","db_name":"^user_","url":"https://hooks.example.com/edited","disabled":true}`)
	assert.Empty(t, s.Fingerprint(events.GroupOnChange, "user_1"), "disabled")
}
