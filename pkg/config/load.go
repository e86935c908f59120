package config

import (
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// process fills spec from SPIEGEL_* variables, with the defaults of its `default` tags. It reads
// only the prefixed names: envconfig.Process would also fall back to the bare tag name
// (COUCHDB_URL, LOG_LEVEL, ...), which lets unrelated variables of the environment configure the
// service by accident.
func process(spec any) error {
	v := reflect.ValueOf(spec)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("config: want a pointer to a struct, got %T", spec)
	}
	return processStruct(v.Elem())
}

func processStruct(v reflect.Value) error {
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		f, fv := t.Field(i), v.Field(i)
		if f.Anonymous && f.Type.Kind() == reflect.Struct {
			if err := processStruct(fv); err != nil {
				return err
			}
			continue
		}
		name := f.Tag.Get("envconfig")
		if name == "" || !fv.CanSet() {
			continue
		}
		key := Prefix + "_" + name
		raw, ok := os.LookupEnv(key)
		if !ok {
			if f.Tag.Get("required") == "true" {
				return fmt.Errorf("%s is required", key)
			}
			raw = f.Tag.Get("default")
		}
		if err := setField(fv, raw); err != nil {
			return fmt.Errorf("%s=%q: %w", key, raw, err)
		}
	}
	return nil
}

func setField(fv reflect.Value, raw string) error {
	switch fv.Interface().(type) {
	case time.Duration:
		if raw == "" {
			fv.SetInt(0)
			return nil
		}
		d, err := time.ParseDuration(raw)
		if err != nil {
			return fmt.Errorf("not a duration (e.g. 500ms, 30s, 10m)")
		}
		fv.SetInt(int64(d))
	case string:
		fv.SetString(raw)
	case int:
		if raw == "" {
			fv.SetInt(0)
			return nil
		}
		n, err := strconv.Atoi(raw)
		if err != nil {
			return fmt.Errorf("not an integer")
		}
		fv.SetInt(int64(n))
	case bool:
		if raw == "" {
			fv.SetBool(false)
			return nil
		}
		b, err := strconv.ParseBool(raw)
		if err != nil {
			return fmt.Errorf("not a boolean (true or false)")
		}
		fv.SetBool(b)
	case []string:
		var out []string
		for _, s := range strings.Split(raw, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
		fv.Set(reflect.ValueOf(out))
	default:
		return fmt.Errorf("unsupported type %s", fv.Type())
	}
	return nil
}
