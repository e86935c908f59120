package rules

import "strings"

// Vars are the values substitution tokens stand for (SPEC §2.2). The tokens are $db_name, $seq,
// $change, $change.id, $change.rev and $change.doc, each also written ${db_name}, ${seq}, ...
type Vars struct {
	DBName    string
	Seq       string // the change's seq, opaque
	ChangeID  string
	ChangeRev string
	Change    map[string]any // the whole _changes row, doc included
	Doc       map[string]any // the changed doc; when nil, $change.doc falls back to Change["doc"]
}

// VarsFromChange fills Vars from db and one _changes row as CouchDB sends it
// ({"seq": .., "id": .., "changes": [{"rev": ..}], "doc": {..}}). A numeric seq (PouchDB) is
// kept as its JSON text.
func VarsFromChange(db string, change map[string]any) Vars {
	v := Vars{DBName: db, Change: change}
	if s, ok := change["seq"]; ok && s != nil {
		v.Seq = fieldText(s)
	}
	v.ChangeID, _ = change["id"].(string)
	if revs, ok := change["changes"].([]any); ok && len(revs) > 0 {
		if m, ok := revs[0].(map[string]any); ok {
			v.ChangeRev, _ = m["rev"].(string)
		}
	}
	v.Doc, _ = change["doc"].(map[string]any)
	if v.ChangeRev == "" && v.Doc != nil {
		v.ChangeRev, _ = v.Doc["_rev"].(string)
	}
	return v
}

// tokenNames lists the known token names, longest first so "$change.doc" wins over "$change".
func tokenName(i int) string {
	switch i {
	case 0:
		return "change.doc"
	case 1:
		return "change.rev"
	case 2:
		return "change.id"
	case 3:
		return "db_name"
	case 4:
		return "change"
	case 5:
		return "seq"
	}
	return ""
}

const tokenCount = 6

// value returns what the token name stands for.
func (v Vars) value(name string) any {
	switch name {
	case "db_name":
		return v.DBName
	case "seq":
		return v.Seq
	case "change":
		if v.Change == nil {
			return nil
		}
		return v.Change
	case "change.id":
		return v.ChangeID
	case "change.rev":
		return v.ChangeRev
	case "change.doc":
		if v.Doc != nil {
			return v.Doc
		}
		if d, ok := v.Change["doc"]; ok {
			return d
		}
		return nil
	}
	return nil
}

// Substitute returns a deep copy of the JSON value v (maps, slices, scalars as decoded by
// encoding/json) with tokens replaced:
//   - a string that is exactly one token ("$change", "${db_name}", ...) becomes that value with its
//     JSON type ($change stays an object, a nil doc becomes null);
//   - "${...}" tokens inside longer strings are interpolated as text (objects as JSON; no
//     escaping); the bare "$name" form is only recognised as a whole string;
//   - unknown tokens, object keys, numbers, booleans and null stay as they are.
//
// The values taken from vars (Change, Doc) are shared, not copied: do not mutate the result's
// substituted objects.
func Substitute(v any, vars Vars) any {
	switch x := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = Substitute(e, vars)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = Substitute(e, vars)
		}
		return out
	case string:
		if !strings.Contains(x, "$") {
			return x
		}
		if name, n, ok := matchToken(x, 0, true); ok && n == len(x) {
			return vars.value(name)
		}
		return interpolate(x, vars, false, false, false)
	default:
		return v
	}
}

// Interpolate replaces every token in tmpl, in both the ${name} and the bare $name form, by its
// value as text (strings as they are, objects and arrays as JSON, a missing doc as "null").
// Unknown tokens stay literal. A bare $name token ends at a byte that cannot continue a name
// ("$db_name/x" works, "$db_names" stays literal).
//
// With urlEscape each substituted value is percent-encoded strictly — every byte outside RFC
// 3986's unreserved set (A-Z a-z 0-9 - . _ ~) becomes %XX — which is safe in a path segment and
// in a query alike ('/', '+', '&', '=', '$' never reach the server raw). The template's own text
// is never altered.
func Interpolate(tmpl string, vars Vars, urlEscape bool) string {
	return interpolate(tmpl, vars, urlEscape, true, false)
}

// interpolate replaces tokens in tmpl: bare enables the $name form, dbOnly limits the tokens
// to db_name (for replicator sources and targets, where a '$' may be part of a db name).
func interpolate(tmpl string, vars Vars, urlEscape, bare, dbOnly bool) string {
	if !strings.Contains(tmpl, "$") {
		return tmpl
	}
	var b strings.Builder
	b.Grow(len(tmpl) + 16)
	for i := 0; i < len(tmpl); {
		if tmpl[i] == '$' {
			if name, n, ok := matchToken(tmpl, i, bare); ok && (!dbOnly || name == "db_name") {
				text := fieldText(vars.value(name))
				if urlEscape {
					text = escapeComponent(text)
				}
				b.WriteString(text)
				i += n
				continue
			}
		}
		b.WriteByte(tmpl[i])
		i++
	}
	return b.String()
}

// matchToken reports whether a known token starts at s[i] ('$'), returning its name and length.
// The braced form always counts; the bare form only when bare is true.
func matchToken(s string, i int, bare bool) (name string, n int, ok bool) {
	if i >= len(s) || s[i] != '$' {
		return "", 0, false
	}
	rest := s[i+1:]
	if strings.HasPrefix(rest, "{") {
		end := strings.IndexByte(rest, '}')
		if end < 0 {
			return "", 0, false
		}
		inner := rest[1:end]
		for t := 0; t < tokenCount; t++ {
			if inner == tokenName(t) {
				return inner, end + 2, true
			}
		}
		return "", 0, false
	}
	if !bare {
		return "", 0, false
	}
	for t := 0; t < tokenCount; t++ {
		name := tokenName(t)
		if !strings.HasPrefix(rest, name) {
			continue
		}
		next := rest[len(name):]
		if next != "" && (isNameByte(next[0]) || name == "change" && next[0] == '.' && len(next) > 1 && isNameByte(next[1])) {
			continue // "$db_names", "$change.foo": not a token
		}
		return name, len(name) + 1, true
	}
	return "", 0, false
}

func isNameByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_'
}

// escapeComponent percent-encodes every byte of s outside RFC 3986's unreserved characters.
func escapeComponent(s string) string {
	const hex = "0123456789ABCDEF"
	n := 0
	for i := 0; i < len(s); i++ {
		if !isUnreserved(s[i]) {
			n++
		}
	}
	if n == 0 {
		return s
	}
	b := make([]byte, 0, len(s)+2*n)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if isUnreserved(c) {
			b = append(b, c)
		} else {
			b = append(b, '%', hex[c>>4], hex[c&15])
		}
	}
	return string(b)
}

func isUnreserved(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
		c == '-' || c == '.' || c == '_' || c == '~'
}
