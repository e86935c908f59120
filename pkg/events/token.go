// Package events defines what travels through NATS: the subject scheme, the encoding of CouchDB
// database names into single NATS subject tokens, and the job payload.
package events

import (
	"errors"
	"fmt"
	"strings"
)

// ErrBadToken is returned by DecodeDBName for a string EncodeDBName cannot have produced.
var ErrBadToken = errors.New("invalid db token")

const hexDigits = "0123456789ABCDEF"

// tokenSafe reports whether b is kept as is in a token. Everything else, including the escape
// character '~' itself, is written as '~' followed by two upper-case hex digits.
func tokenSafe(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '_' || b == '-'
}

// EncodeDBName turns any string into one valid NATS subject token (non-empty, no '.', '*', '>',
// whitespace or control bytes) that DecodeDBName turns back into the same string.
//
// Bytes in [A-Za-z0-9_-] stay as they are, so ordinary names read plainly ("user_42" stays
// "user_42"); every other byte becomes "~XX" (hex), e.g. "a/b+c$d" → "a~2Fb~2Bc~24d". The empty
// string, which no database can be named, encodes as "~" alone.
func EncodeDBName(name string) string {
	if name == "" {
		return "~"
	}
	n := 0
	for i := 0; i < len(name); i++ {
		if !tokenSafe(name[i]) {
			n++
		}
	}
	if n == 0 {
		return name
	}
	var b strings.Builder
	b.Grow(len(name) + 2*n)
	for i := 0; i < len(name); i++ {
		c := name[i]
		if tokenSafe(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('~')
		b.WriteByte(hexDigits[c>>4])
		b.WriteByte(hexDigits[c&0x0F])
	}
	return b.String()
}

// DecodeDBName reverses EncodeDBName. It rejects any token EncodeDBName would not produce, so
// that every name has exactly one token.
func DecodeDBName(token string) (string, error) {
	if token == "~" {
		return "", nil
	}
	if token == "" {
		return "", fmt.Errorf("%w: empty", ErrBadToken)
	}
	if strings.IndexByte(token, '~') < 0 {
		for i := 0; i < len(token); i++ {
			if !tokenSafe(token[i]) {
				return "", fmt.Errorf("%w: %q has byte %q", ErrBadToken, token, token[i])
			}
		}
		return token, nil
	}
	out := make([]byte, 0, len(token))
	for i := 0; i < len(token); i++ {
		c := token[i]
		if tokenSafe(c) {
			out = append(out, c)
			continue
		}
		if c != '~' || i+2 >= len(token) {
			return "", fmt.Errorf("%w: %q has byte %q at %d", ErrBadToken, token, c, i)
		}
		hi, lo := unhex(token[i+1]), unhex(token[i+2])
		if hi < 0 || lo < 0 {
			return "", fmt.Errorf("%w: %q has a bad escape at %d", ErrBadToken, token, i)
		}
		v := byte(hi<<4 | lo)
		if tokenSafe(v) {
			return "", fmt.Errorf("%w: %q escapes a plain byte at %d", ErrBadToken, token, i)
		}
		out = append(out, v)
		i += 2
	}
	return string(out), nil
}

// unhex accepts only upper-case hex digits, the form EncodeDBName writes.
func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}
