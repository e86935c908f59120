package rules

import (
	"regexp"
	"regexp/syntax"
	"slices"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// GroupMask is a set of consumer groups.
type GroupMask uint8

// Bits of a GroupMask.
const (
	MaskReplicate GroupMask = 1 << iota
	MaskOnChange
)

func maskOf(g events.Group) GroupMask {
	switch g {
	case events.GroupReplicate:
		return MaskReplicate
	case events.GroupOnChange:
		return MaskOnChange
	}
	return 0
}

// Has reports whether g is in the set.
func (m GroupMask) Has(g events.Group) bool { return m&maskOf(g) != 0 }

// Groups lists the groups in the set, in events.Groups order.
func (m GroupMask) Groups() []events.Group {
	var out []events.Group
	for _, g := range []events.Group{events.GroupReplicate, events.GroupOnChange} {
		if m.Has(g) {
			out = append(out, g)
		}
	}
	return out
}

// entry holds the enabled rules sharing one db selector (an exact name, a regex source, or
// "every db"), with a per-group count so its mask is O(1).
type entry struct {
	rules map[string]Rule
	n     [2]int // rules of GroupReplicate, GroupOnChange
	mask  GroupMask
}

func (e *entry) add(r Rule) {
	if e.rules == nil {
		e.rules = map[string]Rule{}
	}
	e.rules[r.ID()] = r
	e.count(r, 1)
}

func (e *entry) remove(r Rule) {
	delete(e.rules, r.ID())
	e.count(r, -1)
}

func (e *entry) count(r Rule, d int) {
	i := 0
	if r.Group() == events.GroupOnChange {
		i = 1
	}
	e.n[i] += d
	e.mask = 0
	if e.n[0] > 0 {
		e.mask |= MaskReplicate
	}
	if e.n[1] > 0 {
		e.mask |= MaskOnChange
	}
}

// patEntry is an entry for a regex, filed in the index by what the regex requires of a name.
type patEntry struct {
	entry
	re     *regexp.Regexp
	prefix string // anchored literal prefix: the name must start with it
	lit    string // else a literal of ≥ 3 bytes the name must contain
	gram   string // the 3- or 4-byte piece of lit the entry is filed under
}

// index finds the entries matching a db name without running every regex:
//   - exact names: one map lookup;
//   - anchored patterns with a literal prefix ("^user_"): a map lookup per distinct prefix length;
//   - other patterns with a literal of ≥ 3 bytes anywhere in their top-level sequence: filed
//     under the least crowded 4-byte (or 3-byte) piece of that literal, found with a map lookup
//     per 4-byte (3-byte) window of the name;
//   - the rest are scanned.
//
// Only then do candidate regexes run. Only enabled rules are indexed. Not safe for concurrent
// mutation: Set guards it.
type index struct {
	exact    map[string]*entry
	all      entry // rules without db pattern: every db
	pats     map[string]*patEntry
	byPrefix map[string][]*patEntry
	lens     []int // sorted distinct prefix lengths in byPrefix
	byGram   map[string][]*patEntry
	gramLens [5]int // number of byGram keys of each length (3 and 4)
	scan     []*patEntry
}

func newIndex() *index {
	return &index{
		exact: map[string]*entry{}, pats: map[string]*patEntry{},
		byPrefix: map[string][]*patEntry{}, byGram: map[string][]*patEntry{},
	}
}

// selectorOf returns how r selects dbs: a regex, an exact name, or (neither) every db.
func selectorOf(r Rule) (re *regexp.Regexp, exact string, isExact bool) {
	switch x := r.(type) {
	case *Replicator:
		if x.Pattern == nil {
			return nil, x.ExactDB, true
		}
		return x.Pattern, "", false
	case *OnChange:
		return x.DBPattern, "", false
	}
	return nil, "", false
}

func (ix *index) add(r Rule) {
	re, exact, isExact := selectorOf(r)
	switch {
	case isExact:
		e := ix.exact[exact]
		if e == nil {
			e = &entry{}
			ix.exact[exact] = e
		}
		e.add(r)
	case re == nil:
		ix.all.add(r)
	default:
		src := re.String()
		p := ix.pats[src]
		if p == nil {
			p = &patEntry{re: re}
			p.prefix, p.lit = requiredLiterals(src)
			ix.pats[src] = p
			ix.file(p)
		}
		p.add(r)
	}
}

func (ix *index) remove(r Rule) {
	re, exact, isExact := selectorOf(r)
	switch {
	case isExact:
		if e := ix.exact[exact]; e != nil {
			e.remove(r)
			if len(e.rules) == 0 {
				delete(ix.exact, exact)
			}
		}
	case re == nil:
		ix.all.remove(r)
	default:
		src := re.String()
		if p := ix.pats[src]; p != nil {
			p.remove(r)
			if len(p.rules) == 0 {
				delete(ix.pats, src)
				ix.unfile(p)
			}
		}
	}
}

func (ix *index) file(p *patEntry) {
	switch {
	case p.prefix != "":
		if len(ix.byPrefix[p.prefix]) == 0 {
			ix.addLen(len(p.prefix))
		}
		ix.byPrefix[p.prefix] = append(ix.byPrefix[p.prefix], p)
	case p.lit != "":
		p.gram = ix.pickGram(p.lit)
		if len(ix.byGram[p.gram]) == 0 {
			ix.gramLens[len(p.gram)]++
		}
		ix.byGram[p.gram] = append(ix.byGram[p.gram], p)
	default:
		ix.scan = append(ix.scan, p)
	}
}

func (ix *index) unfile(p *patEntry) {
	drop := func(list []*patEntry) []*patEntry {
		if i := slices.Index(list, p); i >= 0 {
			return slices.Delete(list, i, i+1)
		}
		return list
	}
	switch {
	case p.prefix != "":
		if ix.byPrefix[p.prefix] = drop(ix.byPrefix[p.prefix]); len(ix.byPrefix[p.prefix]) == 0 {
			delete(ix.byPrefix, p.prefix)
			ix.dropLen(len(p.prefix))
		}
	case p.lit != "":
		if ix.byGram[p.gram] = drop(ix.byGram[p.gram]); len(ix.byGram[p.gram]) == 0 {
			delete(ix.byGram, p.gram)
			ix.gramLens[len(p.gram)]--
		}
	default:
		ix.scan = drop(ix.scan)
	}
}

func (ix *index) addLen(n int) {
	if i, found := slices.BinarySearch(ix.lens, n); !found {
		ix.lens = slices.Insert(ix.lens, i, n)
	}
}

// dropLen removes n from lens when no prefix of that length is left.
func (ix *index) dropLen(n int) {
	for p := range ix.byPrefix {
		if len(p) == n {
			return
		}
	}
	if i, found := slices.BinarySearch(ix.lens, n); found {
		ix.lens = slices.Delete(ix.lens, i, i+1)
	}
}

// pickGram returns the piece of lit (4 bytes, or 3 for a 3-byte lit) with the fewest entries
// filed under it, so that patterns sharing a common word ("tenant") spread over their
// distinctive parts.
func (ix *index) pickGram(lit string) string {
	n := min(len(lit), 4)
	best := lit[:n]
	for i := 1; i+n <= len(lit); i++ {
		if g := lit[i : i+n]; len(ix.byGram[g]) < len(ix.byGram[best]) {
			best = g
		}
	}
	return best
}

// walk calls hit for every entry matching db, except that entries for which skip returns true
// are not tested (skip lets Groups stop testing regexes that cannot add a group). An entry may be
// offered more than once; skip must make repeated hits harmless.
func (ix *index) walk(db string, skip func(*entry) bool, hit func(*entry)) {
	if e := ix.exact[db]; e != nil && !skip(e) {
		hit(e)
	}
	if len(ix.all.rules) > 0 && !skip(&ix.all) {
		hit(&ix.all)
	}
	try := func(p *patEntry) {
		if !skip(&p.entry) && p.re.MatchString(db) {
			hit(&p.entry)
		}
	}
	for _, n := range ix.lens {
		if n > len(db) {
			break
		}
		for _, p := range ix.byPrefix[db[:n]] {
			try(p)
		}
	}
	for n := 3; n <= 4; n++ {
		if ix.gramLens[n] == 0 {
			continue
		}
		for i := 0; i+n <= len(db); i++ {
			for _, p := range ix.byGram[db[i:i+n]] {
				try(p)
			}
		}
	}
	for _, p := range ix.scan {
		try(p)
	}
}

// groups returns the groups of the enabled rules matching db.
func (ix *index) groups(db string) GroupMask {
	var m GroupMask
	ix.walk(db, func(e *entry) bool { return e.mask&^m == 0 },
		func(e *entry) { m |= e.mask })
	return m
}

// rules returns the enabled rules matching db, in no particular order.
func (ix *index) rules(db string) []Rule {
	var seen []*entry
	var out []Rule
	ix.walk(db, func(e *entry) bool { return slices.Contains(seen, e) }, func(e *entry) {
		seen = append(seen, e)
		for _, r := range e.rules {
			out = append(out, r)
		}
	})
	return out
}

// requiredLiterals analyses an RE2 source: prefix is the literal an anchored pattern's match
// must start the name with; otherwise lit is the longest literal any match must contain ("" when
// there is none of 3 bytes or more). Case-insensitive literals are ignored.
func requiredLiterals(src string) (prefix, lit string) {
	re, err := syntax.Parse(src, syntax.Perl)
	if err != nil {
		return "", ""
	}
	seq := flattenConcat(re)
	var best string
	var cur strings.Builder
	flush := func() {
		if cur.Len() > len(best) {
			best = cur.String()
		}
		cur.Reset()
	}
	for _, r := range seq {
		if r.Op == syntax.OpLiteral && r.Flags&syntax.FoldCase == 0 {
			cur.WriteString(string(r.Rune))
			continue
		}
		flush()
	}
	flush()
	if len(seq) > 1 && seq[0].Op == syntax.OpBeginText && seq[1].Op == syntax.OpLiteral && seq[1].Flags&syntax.FoldCase == 0 {
		var p strings.Builder
		for _, r := range seq[1:] {
			if r.Op != syntax.OpLiteral || r.Flags&syntax.FoldCase != 0 {
				break
			}
			p.WriteString(string(r.Rune))
		}
		return p.String(), ""
	}
	if len(best) >= 3 {
		return "", best
	}
	return "", ""
}

// flattenConcat returns the sequence of sub-expressions a match runs through, concatenations
// and capture groups flattened.
func flattenConcat(re *syntax.Regexp) []*syntax.Regexp {
	switch re.Op {
	case syntax.OpConcat:
		var out []*syntax.Regexp
		for _, s := range re.Sub {
			out = append(out, flattenConcat(s)...)
		}
		return out
	case syntax.OpCapture:
		return flattenConcat(re.Sub[0])
	}
	return []*syntax.Regexp{re}
}
