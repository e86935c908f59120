package config

import (
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
)

// toolVars are SPIEGEL_* variables that configure no binary but the tests, benchmarks and
// deployments around them; toolPrefixes are their families. Neither is warned about.
var (
	toolVars     = []string{"SPIEGEL_REQUIRE_COUCHDB", "SPIEGEL_IMAGE", "SPIEGEL_VERSION", "SPIEGEL_PASSWORDS_JSON"}
	toolPrefixes = []string{"SPIEGEL_TEST_", "SPIEGEL_BENCH_", "SPIEGEL_SCALE_", "SPIEGEL_DEMO_", "SPIEGEL_RUN_"}
)

// readDeprecated sets each field of spec whose variable is unset from the field of its old name
// (a Var with Deprecated), when that is set.
func readDeprecated(spec any) {
	v := reflect.ValueOf(spec).Elem()
	for _, old := range Vars(spec) {
		if old.Deprecated == "" {
			continue
		}
		_, oldSet := os.LookupEnv(old.Name)
		if _, newSet := os.LookupEnv(old.Deprecated); !oldSet || newSet {
			continue
		}
		from, ok1 := fieldOf(v, old.Name)
		to, ok2 := fieldOf(v, old.Deprecated)
		if ok1 && ok2 && from.Type() == to.Type() {
			to.Set(from)
		}
	}
}

// fieldOf finds the field of struct v (embedded structs included) read from variable name.
func fieldOf(v reflect.Value, name string) (reflect.Value, bool) {
	for i := range v.NumField() {
		sf := v.Type().Field(i)
		if sf.Tag.Get("envconfig") == name {
			return v.Field(i), true
		}
		if sf.Anonymous && sf.Type.Kind() == reflect.Struct {
			if f, ok := fieldOf(v.Field(i), name); ok {
				return f, true
			}
		}
	}
	return reflect.Value{}, false
}

// EnvWarning is something wrong with a SPIEGEL_* variable of the environment that does not stop
// the start: an unknown name (with the nearest known name, if one is near), or an old one.
type EnvWarning struct {
	Name       string
	Suggestion string // the known variable the name is probably a misspelling of ("": none near)
	NewName    string // for a deprecated name, the name to use
}

// String says it in one line.
func (w EnvWarning) String() string {
	switch {
	case w.NewName != "":
		return fmt.Sprintf("%s is deprecated: use %s", w.Name, w.NewName)
	case w.Suggestion != "":
		return fmt.Sprintf("unknown variable %s ignored: did you mean %s?", w.Name, w.Suggestion)
	}
	return fmt.Sprintf("unknown variable %s ignored", w.Name)
}

// CheckEnv returns a warning for each SPIEGEL_* variable of environ (os.Environ's form) that no
// binary reads, with the nearest variable of spec (the binary's configuration) by edit distance
// as a suggestion, and for each deprecated name set. The variables of the other binaries, and
// those of the tests and deployments, are known: they are not warned about.
func CheckEnv(spec any, environ []string) []EnvWarning {
	known := map[string]string{} // name → its new name when deprecated
	for _, s := range []any{&Producer{}, &Replicator{}, &OnChange{}} {
		for _, v := range Vars(s) {
			known[v.Name] = v.Deprecated
		}
	}
	var own []string
	for _, v := range Vars(spec) {
		if v.Deprecated == "" {
			own = append(own, v.Name)
		}
	}
	var out []EnvWarning
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		newName, isKnown := known[name]
		if newName != "" {
			out = append(out, EnvWarning{Name: name, NewName: newName})
			continue
		}
		if !strings.HasPrefix(name, "SPIEGEL_") || isKnown || slices.Contains(toolVars, name) ||
			slices.ContainsFunc(toolPrefixes, func(p string) bool { return strings.HasPrefix(name, p) }) {
			continue
		}
		out = append(out, EnvWarning{Name: name, Suggestion: nearest(name, own)})
	}
	slices.SortFunc(out, func(a, b EnvWarning) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// nearest returns the name of names closest to name by edit distance, if it is near enough to
// be a misspelling (at most a third of the part after SPIEGEL_, at least 2), else "".
func nearest(name string, names []string) string {
	best, bestD := "", 0
	for _, n := range names {
		if d := editDistance(name, n); best == "" || d < bestD {
			best, bestD = n, d
		}
	}
	if limit := max(2, (len(name)-len("SPIEGEL_"))/3); best == "" || bestD > limit {
		return ""
	}
	return best
}

// editDistance is the Levenshtein distance of a and b (bytes: the names are ASCII).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
