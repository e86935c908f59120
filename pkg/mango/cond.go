package mango

import (
	"regexp"
	"strconv"
	"strings"
)

// Compiled selector conditions. Each tests a present value in match and says in matchMissing
// whether it holds for an absent one: only $exists:false (and negations) hold on absence.

type andCond []cond

func (c andCond) match(v any) bool {
	for _, s := range c {
		if !s.match(v) {
			return false
		}
	}
	return true
}

func (c andCond) matchMissing() bool {
	for _, s := range c {
		if !s.matchMissing() {
			return false
		}
	}
	return true
}

// orCond holds when any sub-condition does; an empty $or holds (as in CouchDB).
type orCond []cond

func (c orCond) match(v any) bool {
	for _, s := range c {
		if s.match(v) {
			return true
		}
	}
	return len(c) == 0
}

func (c orCond) matchMissing() bool {
	for _, s := range c {
		if s.matchMissing() {
			return true
		}
	}
	return len(c) == 0
}

type notCond struct{ c cond }

func (c notCond) match(v any) bool   { return !c.c.match(v) }
func (c notCond) matchMissing() bool { return !c.c.matchMissing() }

// fieldCond applies c to the field at path of the value.
type fieldCond struct {
	path []string
	c    cond
}

func (c fieldCond) match(v any) bool {
	sub, ok := lookupPath(v, c.path)
	if !ok {
		return c.c.matchMissing()
	}
	return c.c.match(sub)
}

func (c fieldCond) matchMissing() bool { return c.c.matchMissing() }

// lookupPath walks objects by key and arrays by decimal index.
func lookupPath(v any, path []string) (any, bool) {
	for _, seg := range path {
		switch x := v.(type) {
		case map[string]any:
			var ok bool
			if v, ok = x[seg]; !ok {
				return nil, false
			}
		case []any:
			i, err := strconv.Atoi(seg)
			if err != nil || i < 0 || i >= len(x) {
				return nil, false
			}
			v = x[i]
		default:
			return nil, false
		}
	}
	return v, true
}

// present is embedded by leaf conditions: false on an absent field.
type present struct{}

func (present) matchMissing() bool { return false }

type eqCond struct{ arg any }

func (c eqCond) match(v any) bool { return collate(v, c.arg) == 0 }
func (eqCond) matchMissing() bool { return false }

type neCond struct{ arg any }

func (c neCond) match(v any) bool { return collate(v, c.arg) != 0 }
func (neCond) matchMissing() bool { return false }

type compareCond struct {
	present
	op  string
	arg any
}

func (c compareCond) match(v any) bool {
	r := collate(v, c.arg)
	switch c.op {
	case "$gt":
		return r > 0
	case "$gte":
		return r >= 0
	case "$lt":
		return r < 0
	default: // $lte
		return r <= 0
	}
}

// setCond is $in, $nin or $all.
type setCond struct {
	present
	op   string
	args []any
}

func (c setCond) has(v any) bool {
	for _, a := range c.args {
		if collate(v, a) == 0 {
			return true
		}
	}
	return false
}

func (c setCond) match(v any) bool {
	arr, isArr := v.([]any)
	switch c.op {
	case "$in", "$nin":
		in := c.has(v)
		if isArr && !in {
			for _, e := range arr {
				if c.has(e) {
					in = true
					break
				}
			}
		}
		return in == (c.op == "$in")
	default: // $all
		if !isArr || len(c.args) == 0 {
			return false
		}
		for _, a := range c.args {
			found := false
			for _, e := range arr {
				if collate(e, a) == 0 {
					found = true
					break
				}
			}
			if !found {
				return false
			}
		}
		return true
	}
}

type existsCond bool

func (c existsCond) match(any) bool     { return bool(c) }
func (c existsCond) matchMissing() bool { return !bool(c) }

type typeCond string

func (typeCond) matchMissing() bool { return false }
func (c typeCond) match(v any) bool {
	switch rank(v) {
	case rankNull:
		return c == "null"
	case rankFalse, rankTrue:
		return c == "boolean"
	case rankNumber:
		return c == "number"
	case rankString:
		return c == "string"
	case rankArray:
		return c == "array"
	case rankObject:
		return c == "object"
	}
	return false
}

type regexCond struct{ re *regexp.Regexp }

func (regexCond) matchMissing() bool { return false }
func (c regexCond) match(v any) bool {
	s, ok := v.(string)
	return ok && c.re.MatchString(s)
}

type prefixCond string

func (prefixCond) matchMissing() bool { return false }
func (c prefixCond) match(v any) bool {
	s, ok := v.(string)
	return ok && strings.HasPrefix(s, string(c))
}

type sizeCond int64

func (sizeCond) matchMissing() bool { return false }
func (c sizeCond) match(v any) bool {
	arr, ok := v.([]any)
	return ok && int64(len(arr)) == int64(c)
}

type modCond struct {
	present
	d, r int64
}

func (c modCond) match(v any) bool {
	n, ok := toInt(v)
	return ok && n%c.d == c.r // Go defines MinInt64 % -1 as 0: no overflow panic
}

// arrayCond is $elemMatch (some element matches), $allMatch (a non-empty array whose elements
// all match) or $keyMapMatch (an object with some key matching).
type arrayCond struct {
	present
	op string
	c  cond
}

func (c arrayCond) match(v any) bool {
	if c.op == "$keyMapMatch" {
		obj, ok := v.(map[string]any)
		if !ok {
			return false
		}
		for k := range obj {
			if c.c.match(k) {
				return true
			}
		}
		return false
	}
	arr, ok := v.([]any)
	if !ok || len(arr) == 0 {
		return false
	}
	for _, e := range arr {
		m := c.c.match(e)
		if c.op == "$elemMatch" && m {
			return true
		}
		if c.op == "$allMatch" && !m {
			return false
		}
	}
	return c.op == "$allMatch"
}
