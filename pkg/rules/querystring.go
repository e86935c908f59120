package rules

import (
	"encoding/json"
	"math"
	"sort"
	"strconv"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/mango"
)

// QueryString encodes params as Node's `qs.stringify(params)` does with its defaults (bracket
// notation, "indices" array format, RFC 3986 encoding of keys and values), for GET and DELETE
// webhooks:
//
//	{"a":1,"b":{"c":"x"},"d":[1,2]} → a=1&b%5Bc%5D=x&d%5B0%5D=1&d%5B1%5D=2
//
// Differences from qs, forced by Go maps: object keys are emitted in sorted (byte) order, not
// insertion order. Like qs: null gives "key=", booleans "true"/"false", numbers their JavaScript
// text, empty objects and arrays are left out, and a params value that is not an object or an
// array (including nil) gives "". The result has no leading '?'.
func QueryString(params any) string {
	var parts []string
	switch params.(type) {
	case map[string]any, []any:
		parts = appendQuery(parts, "", params)
	default:
		return ""
	}
	return strings.Join(parts, "&")
}

func appendQuery(parts []string, prefix string, v any) []string {
	key := func(k string) string {
		if prefix == "" {
			return k
		}
		return prefix + "[" + k + "]"
	}
	switch x := v.(type) {
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			parts = appendQuery(parts, key(k), x[k])
		}
		return parts
	case []any:
		for i, e := range x {
			parts = appendQuery(parts, key(strconv.Itoa(i)), e)
		}
		return parts
	}
	return append(parts, escapeComponent(prefix)+"="+escapeComponent(scalarText(v)))
}

// scalarText renders a JSON scalar the way JavaScript's String() does.
func scalarText(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		return x
	case bool:
		return strconv.FormatBool(x)
	case json.Number:
		s := string(x)
		if !strings.ContainsAny(s, ".eE") && s != "-0" {
			return s // integers keep every digit
		}
		if f, err := x.Float64(); err == nil {
			return jsNumber(f)
		}
		return s
	}
	if f, ok := mango.Number(v); ok {
		return jsNumber(f)
	}
	return fieldText(v)
}

// jsNumber formats f as JavaScript's Number.prototype.toString does.
func jsNumber(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	case f == 0:
		return "0"
	}
	abs := math.Abs(f)
	if abs >= 1e-6 && abs < 1e21 {
		return strconv.FormatFloat(f, 'f', -1, 64)
	}
	s := strconv.FormatFloat(f, 'e', -1, 64) // 1e+21, 1e-07
	mant, exp, _ := strings.Cut(s, "e")
	sign := exp[0]
	exp = strings.TrimLeft(exp[1:], "0")
	return mant + "e" + string(sign) + exp
}
