package rules

import (
	"fmt"
	"testing"
)

// benchSet builds a set of rules: exact replicators on "db%05d", and patterns made by pattern(i).
func benchSet(b *testing.B, exact, patterns int, pattern func(i int) string) *Set {
	b.Helper()
	s := NewSet()
	for i := 0; i < exact; i++ {
		doc := fmt.Sprintf(`{"type":"replicator","source":"http://u@h:5984/db%05d","target":"t"}`, i)
		if _, err := s.Apply(fmt.Sprintf("e%d", i), []byte(doc), false); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; i < patterns; i++ {
		kind := `"type":"on_change","url":"http://h/x"`
		if i%2 == 0 {
			kind = `"type":"replicator","source":"$db_name","target":"t"`
		}
		doc := fmt.Sprintf(`{%s,"db_name":%q}`, kind, pattern(i))
		if _, err := s.Apply(fmt.Sprintf("p%d", i), []byte(doc), false); err != nil {
			b.Fatal(err)
		}
	}
	return s
}

// coldNames returns n distinct db names: a third match a pattern, a third an exact rule (with a
// suffix, so they are distinct and match nothing exact), a third nothing.
func coldNames(n, patterns int) []string {
	out := make([]string, n)
	for i := range out {
		switch i % 3 {
		case 0:
			out[i] = fmt.Sprintf("tenant%05d_user%07d", i%max(patterns, 1), i)
		case 1:
			out[i] = fmt.Sprintf("db%05d_%07d", i%9000, i)
		default:
			out[i] = fmt.Sprintf("other_%07d", i)
		}
	}
	return out
}

// BenchmarkGroups measures Set.Groups with 10,000 rules.
//   - warm: 1,000 db names repeated (cache hits);
//   - cold: 1,000,000 distinct names cycled (more than the cache holds), so every call misses
//     the cache, walks the index and inserts into the cache;
//   - index: the uncached index walk alone.
func BenchmarkGroups(b *testing.B) {
	cases := []struct {
		name            string
		exact, patterns int
		pattern         func(i int) string
	}{
		{"9000exact+1000anchored", 9000, 1000, func(i int) string { return fmt.Sprintf("^tenant%05d_", i) }},
		{"10000anchored", 0, 10000, func(i int) string { return fmt.Sprintf("^tenant%05d_", i) }},
		{"10000unanchored", 0, 10000, func(i int) string { return fmt.Sprintf("tenant%05d_", i) }},
		{"10000anchored-complex", 0, 10000, func(i int) string { return fmt.Sprintf(`^tenant%05d_(user|admin)\d+$`, i) }},
		{"1000noliteral", 0, 1000, func(i int) string { return fmt.Sprintf(`(?i)^t[a-z]+%d_`, i) }},
	}
	for _, c := range cases {
		s := benchSet(b, c.exact, c.patterns, c.pattern)
		names := coldNames(1_000_000, c.patterns)
		next := 0 // names already seen stay seen across runs: continue after them
		b.Run(c.name+"/cold", func(b *testing.B) {
			s.mu.Lock()
			s.cache.Store(newGroupCache(s.gen))
			s.mu.Unlock()
			b.ReportAllocs()
			i := next
			defer func() { next = i }()
			for b.Loop() {
				s.Groups(names[i%len(names)])
				i++
			}
		})
		b.Run(c.name+"/index", func(b *testing.B) {
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				s.mu.RLock()
				s.idx.groups(names[i%len(names)])
				s.mu.RUnlock()
				i++
			}
		})
		warm := names[:999]
		for _, n := range warm {
			s.Groups(n)
		}
		b.Run(c.name+"/warm", func(b *testing.B) {
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				s.Groups(warm[i%len(warm)])
				i++
			}
		})
		b.Run(c.name+"/warm-parallel", func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					s.Groups(warm[i%len(warm)])
					i++
				}
			})
		})
	}
}

// BenchmarkParse measures compiling one on_change rule with a selector.
func BenchmarkParse(b *testing.B) {
	doc := []byte(exampleDocs["spec on_change url"])
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse("oc", doc); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSetLoad measures applying 10,000 rules to an empty set (a producer's start).
func BenchmarkSetLoad(b *testing.B) {
	docs := make([][]byte, 10000)
	for i := range docs {
		docs[i] = fmt.Appendf(nil, `{"type":"replicator","db_name":"^tenant%05d_","source":"$db_name","target":"t"}`, i)
	}
	for b.Loop() {
		s := NewSet()
		for i, d := range docs {
			if _, err := s.Apply(fmt.Sprint(i), d, false); err != nil {
				b.Fatal(err)
			}
		}
	}
}
