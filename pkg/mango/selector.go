// Package mango evaluates CouchDB Mango selectors locally, on decoded or raw JSON documents, with
// CouchDB's view collation. Pure: no I/O. Rules (on_change "selector") and the native
// replication engine (a replication's "selector" on servers without _selector) use it.
package mango

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// Selector is a compiled CouchDB Mango selector, evaluated locally on documents. It is immutable
// and safe for concurrent use.
//
// Supported: implicit equality ({"a": "x"}), nested objects ({"a": {"b": 1}} means a.b == 1),
// dotted paths ("a.b", "tags.0"; "\." escapes a dot), the combinators $and $or $nor $not (at any
// level), and the field operators $eq $ne $gt $gte $lt $lte $in $nin $exists $type $regex
// $size $mod $all $elemMatch $allMatch $keyMapMatch $beginsWith. As in CouchDB: equality is exact
// (an array field does not equal one of its elements, use $elemMatch or $all), comparisons
// across types follow view collation (see collate), and a condition on a missing field is false
// except {"$exists": false} and negations of conditions that are false. Regexes are RE2, not
// PCRE, and unanchored.
type Selector struct {
	root cond
}

// cond is a compiled condition on one JSON value.
type cond interface {
	// match tests the condition against a present value.
	match(v any) bool
	// matchMissing tells whether the condition holds for a value that is absent.
	matchMissing() bool
}

// Compile compiles a Mango selector (decoded with encoding/json, numbers as float64 or
// json.Number). An unknown operator or a malformed argument is an error naming the operator.
func Compile(sel map[string]any) (*Selector, error) {
	c, err := compileObject(sel)
	if err != nil {
		return nil, err
	}
	return &Selector{root: c}, nil
}

// Match reports whether doc satisfies the selector. A nil doc is treated as an empty object.
func (s *Selector) Match(doc map[string]any) bool {
	if doc == nil {
		doc = map[string]any{}
	}
	return s.root.match(doc)
}

// MatchRaw decodes a JSON document (numbers as json.Number) and matches it; anything but a JSON
// object does not match.
func (s *Selector) MatchRaw(raw []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil || doc == nil {
		return false
	}
	return s.Match(doc)
}

// compileObject compiles an object of conditions that must all hold: "$op" keys apply to the
// value itself, other keys to its fields.
func compileObject(obj map[string]any) (cond, error) {
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	slices.Sort(keys) // deterministic errors and evaluation order
	all := make(andCond, 0, len(keys))
	for _, k := range keys {
		arg := obj[k]
		var c cond
		var err error
		if strings.HasPrefix(k, "$") {
			c, err = compileOperator(k, arg)
		} else {
			var sub cond
			if sub, err = compileFieldValue(arg); err == nil {
				c = fieldCond{path: splitPath(k), c: sub}
			}
		}
		if err != nil {
			return nil, err
		}
		all = append(all, c)
	}
	if len(all) == 1 {
		return all[0], nil
	}
	return all, nil
}

// compileFieldValue compiles the right-hand side of a field key: an operator object, nested
// field conditions, or a value for implicit equality.
func compileFieldValue(arg any) (cond, error) {
	if obj, ok := arg.(map[string]any); ok && len(obj) > 0 {
		return compileObject(obj)
	}
	return eqCond{arg}, nil
}

// compileSubselector compiles the argument of $not, $elemMatch, $allMatch, $keyMapMatch.
func compileSubselector(op string, arg any) (cond, error) {
	obj, ok := arg.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("operator %s: argument must be an object", op)
	}
	return compileObject(obj)
}

func compileList(op string, arg any) ([]cond, error) {
	list, ok := arg.([]any)
	if !ok {
		return nil, fmt.Errorf("operator %s: argument must be an array of selectors", op)
	}
	out := make([]cond, 0, len(list))
	for _, e := range list {
		c, err := compileSubselector(op, e)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

func compileOperator(op string, arg any) (cond, error) {
	switch op {
	case "$and", "$or", "$nor":
		subs, err := compileList(op, arg)
		if err != nil {
			return nil, err
		}
		switch op {
		case "$and":
			return andCond(subs), nil
		case "$or":
			return orCond(subs), nil
		}
		return notCond{orCond(subs)}, nil
	case "$not":
		sub, err := compileSubselector(op, arg)
		return notCond{sub}, err
	case "$elemMatch", "$allMatch", "$keyMapMatch":
		sub, err := compileSubselector(op, arg)
		if err != nil {
			return nil, err
		}
		return arrayCond{op: op, c: sub}, nil
	case "$eq":
		return eqCond{arg}, nil
	case "$ne":
		return neCond{arg}, nil
	case "$gt", "$gte", "$lt", "$lte":
		return compareCond{op: op, arg: arg}, nil
	case "$in", "$nin", "$all":
		list, ok := arg.([]any)
		if !ok {
			return nil, fmt.Errorf("operator %s: argument must be an array", op)
		}
		return setCond{op: op, args: list}, nil
	case "$exists":
		b, ok := arg.(bool)
		if !ok {
			return nil, fmt.Errorf("operator $exists: argument must be true or false")
		}
		return existsCond(b), nil
	case "$type":
		s, _ := arg.(string)
		switch s {
		case "null", "boolean", "number", "string", "array", "object":
			return typeCond(s), nil
		}
		return nil, fmt.Errorf("operator $type: argument must be one of null, boolean, number, string, array, object")
	case "$regex":
		s, ok := arg.(string)
		if !ok {
			return nil, fmt.Errorf("operator $regex: argument must be a string")
		}
		re, err := regexp.Compile(s)
		if err != nil {
			return nil, fmt.Errorf("operator $regex: invalid regular expression (RE2 syntax): %w", err)
		}
		return regexCond{re}, nil
	case "$beginsWith":
		s, ok := arg.(string)
		if !ok {
			return nil, fmt.Errorf("operator $beginsWith: argument must be a string")
		}
		return prefixCond(s), nil
	case "$size":
		n, ok := toInt(arg)
		if !ok || n < 0 {
			return nil, fmt.Errorf("operator $size: argument must be a non-negative integer")
		}
		return sizeCond(n), nil
	case "$mod":
		list, ok := arg.([]any)
		if ok && len(list) == 2 {
			d, ok1 := toInt(list[0])
			r, ok2 := toInt(list[1])
			if ok1 && ok2 && d != 0 {
				return modCond{d: d, r: r}, nil
			}
		}
		return nil, fmt.Errorf("operator $mod: argument must be [divisor, remainder], integers, divisor not 0")
	}
	return nil, fmt.Errorf("unknown operator %s", op)
}

// splitPath splits a dotted field path; a backslash escapes the next byte (`a\.b` is one field).
func splitPath(key string) []string {
	if !strings.Contains(key, `\`) {
		return strings.Split(key, ".")
	}
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(key); i++ {
		switch c := key[i]; {
		case c == '\\' && i+1 < len(key):
			i++
			cur.WriteByte(key[i])
		case c == '.':
			parts = append(parts, cur.String())
			cur.Reset()
		default:
			cur.WriteByte(c)
		}
	}
	return append(parts, cur.String())
}
