package config

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"

	"github.com/kelseyhightower/envconfig"
)

// process fills spec from the environment with envconfig. Every tag holds the full variable
// name (SPIEGEL_...) and the prefix is empty, so only those names are read: with a prefix,
// envconfig would fall back to the bare tag (COUCHDB_URL, LOG_LEVEL, ...) and let unrelated
// variables of the environment configure the service by accident. A variable that does not
// parse gives an error naming it and its value (no setting that fails to parse is a secret);
// comma-separated lists are trimmed of spaces and empty items. A renamed variable is read from
// its old name when the new one is unset (a Var's Deprecated).
func process(spec any) error {
	err := envconfig.Process("", spec)
	var pe *envconfig.ParseError
	switch {
	case errors.As(err, &pe):
		return fmt.Errorf("%s=%q: %s", pe.KeyName, pe.Value, parseProblem(pe))
	case err != nil:
		if key, ok := strings.CutPrefix(err.Error(), "required key "); ok {
			return fmt.Errorf("%s is required", strings.TrimSuffix(key, " missing value"))
		}
		return err
	}
	readDeprecated(spec)
	trimLists(reflect.ValueOf(spec).Elem())
	return nil
}

// parseProblem says in words what a value should look like.
func parseProblem(pe *envconfig.ParseError) string {
	switch pe.TypeName {
	case "time.Duration":
		return "not a duration (e.g. 500ms, 30s, 10m)"
	case "int":
		return "not an integer"
	case "bool":
		return "not a boolean (true or false)"
	}
	return pe.Err.Error()
}

// trimLists trims the items of every []string field of v (a struct, embedded ones included) and
// drops the empty ones: "a, b," is [a b].
func trimLists(v reflect.Value) {
	for i := range v.NumField() {
		f := v.Field(i)
		switch {
		case f.Kind() == reflect.Struct:
			trimLists(f)
		case f.Type() == reflect.TypeOf([]string(nil)) && f.CanSet():
			var out []string
			for _, s := range f.Interface().([]string) {
				if s = strings.TrimSpace(s); s != "" {
					out = append(out, s)
				}
			}
			f.Set(reflect.ValueOf(out))
		}
	}
}

// HTTPAddr returns the health and metrics listener address of spec (a binary's configuration)
// from the environment as Load would read it — SPIEGEL_HTTP_ADDR when set, even to "" (off), else
// the binary's default — without reading or validating anything else: the healthcheck command
// asks the listener whether the process is alive, and nothing else decides its answer.
func HTTPAddr(spec any) string {
	if v, ok := os.LookupEnv("SPIEGEL_HTTP_ADDR"); ok {
		return v
	}
	for _, v := range Vars(spec) {
		if v.Name == "SPIEGEL_HTTP_ADDR" {
			return v.Default
		}
	}
	return ""
}
