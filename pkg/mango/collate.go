package mango

import (
	"cmp"
	"encoding/json"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Number returns the value of a JSON number in any of the Go forms a decoder gives (float64,
// json.Number, int, int64, float32), and false for anything else. A json.Number out of float64
// range saturates to ±Inf.
func Number(v any) (float64, bool) {
	switch x := v.(type) {
	case float64:
		return x, true
	case json.Number:
		f, err := x.Float64()
		if err != nil {
			// Out of float range: still a number, saturate.
			if strings.HasPrefix(string(x), "-") {
				return math.Inf(-1), isNumberText(string(x))
			}
			return math.Inf(1), isNumberText(string(x))
		}
		return f, true
	case int:
		return float64(x), true
	case int64:
		return float64(x), true
	case float32:
		return float64(x), true
	}
	return 0, false
}

func isNumberText(s string) bool {
	_, err := strconv.ParseFloat(s, 64)
	return err == nil || strings.Contains(err.Error(), "range")
}

// toInt returns the value of a JSON number that is an integer.
func toInt(v any) (int64, bool) {
	switch x := v.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return i, true
		}
	case int:
		return int64(x), true
	case int64:
		return x, true
	}
	f, ok := Number(v)
	if !ok || f != math.Trunc(f) || f < math.MinInt64 || f >= math.MaxInt64 {
		return 0, false
	}
	return int64(f), true
}

// collation ranks of JSON types, in CouchDB's order.
const (
	rankNull = iota
	rankFalse
	rankTrue
	rankNumber
	rankString
	rankArray
	rankObject
	rankOther
)

func rank(v any) int {
	switch x := v.(type) {
	case nil:
		return rankNull
	case bool:
		if x {
			return rankTrue
		}
		return rankFalse
	case string:
		return rankString
	case []any:
		return rankArray
	case map[string]any:
		return rankObject
	}
	if _, ok := Number(v); ok {
		return rankNumber
	}
	return rankOther
}

// collate compares two JSON values in CouchDB's view collation order: null < false < true <
// numbers < strings < arrays < objects. Numbers compare by value (integers exactly). Strings
// approximate ICU's root collation: case-insensitively first, then lowercase before uppercase,
// then by bytes, so only identical strings compare equal. Arrays compare element by element,
// then by length; objects compare their (key, value) pairs in sorted key order, then by size.
func collate(a, b any) int {
	ra, rb := rank(a), rank(b)
	if ra != rb {
		return cmp.Compare(ra, rb)
	}
	switch ra {
	case rankNumber:
		if ia, ok := toInt(a); ok {
			if ib, ok := toInt(b); ok {
				return cmp.Compare(ia, ib)
			}
		}
		fa, _ := Number(a)
		fb, _ := Number(b)
		return cmp.Compare(fa, fb)
	case rankString:
		return collateString(a.(string), b.(string))
	case rankArray:
		xa, xb := a.([]any), b.([]any)
		for i := 0; i < len(xa) && i < len(xb); i++ {
			if c := collate(xa[i], xb[i]); c != 0 {
				return c
			}
		}
		return cmp.Compare(len(xa), len(xb))
	case rankObject:
		ma, mb := a.(map[string]any), b.(map[string]any)
		ka, kb := sortedKeys(ma), sortedKeys(mb)
		for i := 0; i < len(ka) && i < len(kb); i++ {
			if c := collateString(ka[i], kb[i]); c != 0 {
				return c
			}
			if c := collate(ma[ka[i]], mb[kb[i]]); c != 0 {
				return c
			}
		}
		return cmp.Compare(len(ka), len(kb))
	}
	return 0 // null, false, true: equal within their rank; unknown Go types: incomparable
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func collateString(a, b string) int {
	if a == b {
		return 0
	}
	oa, ob := a, b
	// Primary: case-folded runes.
	tie := 0
	for a != "" && b != "" {
		ra, na := utf8.DecodeRuneInString(a)
		rb, nb := utf8.DecodeRuneInString(b)
		la, lb := unicode.ToLower(ra), unicode.ToLower(rb)
		if la != lb {
			return cmp.Compare(la, lb)
		}
		if tie == 0 && ra != rb {
			// Tertiary: lowercase first.
			if unicode.IsLower(ra) && !unicode.IsLower(rb) {
				tie = -1
			} else if unicode.IsLower(rb) && !unicode.IsLower(ra) {
				tie = 1
			} else {
				tie = cmp.Compare(ra, rb)
			}
		}
		a, b = a[na:], b[nb:]
	}
	if a != "" || b != "" {
		return cmp.Compare(len(a), len(b))
	}
	if tie != 0 {
		return tie
	}
	return strings.Compare(oa, ob) // invalid UTF-8 bytes decode to the same rune
}
