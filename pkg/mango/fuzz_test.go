package mango

import (
	"bytes"
	"encoding/json"
	"testing"
)

func decodeNumbers(data []byte) (any, bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	return v, true
}

// FuzzSelector: compiling and matching arbitrary selectors and docs never panics; Match and
// MatchRaw agree; collation is antisymmetric.
func FuzzSelector(f *testing.F) {
	f.Add([]byte(`{"a":{"$gt":1},"$or":[{"b":"x"},{"c":{"$elemMatch":{"$in":[1,2]}}}]}`), []byte(`{"a":2,"b":"x","c":[1]}`))
	f.Add([]byte(`{"a.b":{"$mod":[-1,0]},"t":{"$size":0}}`), []byte(`{"a":{"b":-9223372036854775808},"t":[]}`))
	f.Add([]byte(`{"$not":{"x":{"$regex":"^a"}},"y":{"$all":[[1]]}}`), []byte(`{"y":[[1],2]}`))
	f.Fuzz(func(t *testing.T, selRaw, docRaw []byte) {
		sv, ok := decodeNumbers(selRaw)
		if !ok {
			return
		}
		selMap, ok := sv.(map[string]any)
		if !ok {
			return
		}
		sel, err := Compile(selMap)
		dv, docOK := decodeNumbers(docRaw)
		if docOK {
			if c1, c2 := collate(sv, dv), collate(dv, sv); c1 != -c2 {
				t.Fatalf("collate not antisymmetric: %d vs %d", c1, c2)
			}
			if collate(dv, dv) != 0 {
				t.Fatalf("collate(x, x) != 0")
			}
		}
		if err != nil {
			return
		}
		raw := sel.MatchRaw(docRaw)
		if doc, ok := dv.(map[string]any); ok && docOK && doc != nil {
			if m := sel.Match(doc); m != raw {
				t.Fatalf("Match %v != MatchRaw %v", m, raw)
			}
		}
	})
}
