package rules

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/santhosh-tekuri/jsonschema/v6/kind"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/rules/schema"
)

// compileSchema compiles pkg/rules/schema's rule schema.
func compileSchema(t *testing.T) *jsonschema.Schema {
	t.Helper()
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(schema.Rule()))
	require.NoError(t, err)
	c := jsonschema.NewCompiler()
	require.NoError(t, c.AddResource(schema.ID, doc))
	s, err := c.Compile(schema.ID)
	require.NoError(t, err)
	return s
}

// withID returns doc (a JSON object) with "_id": id, as a rule file holds it.
func withID(t *testing.T, doc, id string) []byte {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(doc), &m), doc)
	m["_id"], _ = json.Marshal(id)
	out, err := json.Marshal(m)
	require.NoError(t, err)
	return out
}

// schemaErrors validates doc against s and returns the fields the failures are about ("source",
// "retry.backoff"): the instance locations of the leaf errors, with the names of missing and
// unexpected properties; nil when doc is valid.
func schemaErrors(t *testing.T, s *jsonschema.Schema, doc []byte) []string {
	t.Helper()
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(doc))
	require.NoError(t, err)
	err = s.Validate(inst)
	if err == nil {
		return nil
	}
	var ve *jsonschema.ValidationError
	require.True(t, errors.As(err, &ve), "%v", err)
	var fields []string
	var walk func(*jsonschema.ValidationError)
	walk = func(e *jsonschema.ValidationError) {
		if _, ok := e.ErrorKind.(*kind.PropertyNames); ok {
			// Its causes are about a name, not a value; and its instance location is not to be
			// trusted (v6.0.3 gives another property's): the field is the one whose schema failed.
			_, after, _ := strings.Cut(e.SchemaURL, "#/$defs/on_change/properties/")
			name, _, _ := strings.Cut(after, "/")
			fields = append(fields, name)
			return
		}
		if len(e.Causes) > 0 {
			for _, c := range e.Causes {
				walk(c)
			}
			return
		}
		var names []string
		switch k := e.ErrorKind.(type) {
		case *kind.Required:
			names = k.Missing
		case *kind.AdditionalProperties:
			names = k.Properties
		}
		if len(names) == 0 {
			fields = append(fields, strings.Join(e.InstanceLocation, "."))
		}
		for _, n := range names {
			fields = append(fields, strings.Join(append(append([]string{}, e.InstanceLocation...), n), "."))
		}
	}
	walk(ve)
	return fields
}

// about reports whether one of the schema's failure fields is field or inside it.
func about(fields []string, field string) bool {
	for _, f := range fields {
		if f == field || strings.HasPrefix(f, field+".") {
			return true
		}
	}
	return false
}

// Every rule doc the parser accepts — the examples of SPEC §2 and the original Spiegel, and one
// doc using every field — validates against the schema.
func TestSchemaAcceptsWhatTheParserAccepts(t *testing.T) {
	t.Parallel()
	s := compileSchema(t)
	docs := map[string]string{
		"every on_change field": `{"type":"on_change","db_name":null,"if":{"a":"^x$","b":null},"selector":{"n":{"$gt":1}},
			"url":"HTTPS://bob@api.example:8443/h/${db_name}?x=1","subject":"","mirror":null,"method":"Patch",
			"params":{"n":1.5,"deep":[{"x":"$change"}]},"headers":{"X-Token":"t","Content-Type":"application/json"},
			"block":true,"debounce":null,"follow_redirects":false,"since":"now","signing":"both","disabled":null,"timeout_ms":2500,
			"retry":{"backoff":"linear","delay_ms":10,"max_delay_ms":null,"multiplier":1,"limit":0}}`,
		"mirror":             `{"type":"on_change","mirror":"my_docs-1","since":""}`,
		"standard signing":   `{"type":"on_change","url":"https://h/x","signing":"standard"}`,
		"v1 signing":         `{"type":"on_change","url":"https://h/x","signing":"v1"}`,
		"default signing":    `{"type":"on_change","url":"https://h/x","signing":null}`,
		"subject with dots":  `{"type":"on_change","subject":"orders.$change.id.${db_name}","method":""}`,
		"native replicator":  `{"type":"replicator","source":"http://h:5984/a%2Fb/","target":"b","engine":"native","dirty_after_milliseconds":null}`,
		"port and @ in path": `{"type":"replicator","source":"https://h:8080/p@x","target":"b","continuous":true,"_deleted_at":"x"}`,
		"pattern, any source": `{"type":"replicator","db_name":"","source":"http://h:5984/","target":"$db_name",
			"source_proxy":"http://proxy:3128","create_target":true,"locked_at":"http://u:p@old"}`,
	}
	for name, doc := range exampleDocs {
		docs[name] = doc
	}
	for name, doc := range docs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse("rule-1", []byte(doc))
			require.NoError(t, err, "the parser must accept the fixture")
			assert.Empty(t, schemaErrors(t, s, withID(t, doc, "rule-1")))
		})
	}
}

// Docs the parser rejects for a field are rejected by the schema for that field (the cases its
// structure can describe; regexes, selectors and the subject policy are the parser's alone).
func TestSchemaRejectsFieldsTheParserRejects(t *testing.T) {
	t.Parallel()
	s := compileSchema(t)
	const secret = "s3cr3t"
	tests := []struct{ field, doc string }{
		{"source", `{"type":"replicator","target":"b"}`},
		{"source", `{"type":"replicator","source":{"url":"x"},"target":"b"}`},
		{"source", `{"type":"replicator","source":" \t","target":"b"}`},
		{"target", `{"type":"replicator","source":"a"}`},
		{"source", `{"type":"replicator","source":"http://h:5984/","target":"b"}`},
		{"source", `{"type":"replicator","source":"http://h:5984//","target":"b"}`},
		{"source", `{"type":"replicator","source":"http://u:` + secret + `@h/db","target":"b"}`},
		{"target", `{"type":"replicator","source":"a","target":"https://u:` + secret + `@h/db"}`},
		{"source_proxy", `{"type":"replicator","source":"a","target":"b","source_proxy":"http://u:` + secret + `@p:3128"}`},
		{"source", `{"type":"replicator","source":"http://h/$db_name","target":"b"}`},
		{"source", `{"type":"replicator","db_name":null,"source":"${db_name}","target":"b"}`},
		{"db_name", `{"type":"replicator","db_name":3,"source":"a","target":"b"}`},
		{"disabled", `{"type":"replicator","source":"a","target":"b","disabled":"yes"}`},
		{"dirty_after_milliseconds", `{"type":"replicator","source":"a","target":"b","dirty_after_milliseconds":-1}`},
		{"dirty_after_milliseconds", `{"type":"replicator","source":"a","target":"b","dirty_after_milliseconds":"5"}`},
		{"engine", `{"type":"replicator","source":"a","target":"b","engine":"rsync"}`},
		{"url", `{"type":"on_change"}`},
		{"url", `{"type":"on_change","url":"","subject":null}`},
		{"subject", `{"type":"on_change","url":"http://h/x","subject":"a.b"}`},
		{"mirror", `{"type":"on_change","url":"http://h/x","mirror":"docs"}`},
		{"mirror", `{"type":"on_change","subject":"a.b","mirror":"docs"}`},
		{"mirror", `{"type":"on_change","mirror":"my.docs"}`},
		{"mirror", `{"type":"on_change","mirror":true}`},
		{"url", `{"type":"on_change","url":"/hook"}`},
		{"url", `{"type":"on_change","url":"ftp://h/x"}`},
		{"url", `{"type":"on_change","url":"https://u:` + secret + `@api/x"}`},
		{"method", `{"type":"on_change","url":"http://h/x","method":"HEAD"}`},
		{"method", `{"type":"on_change","url":"http://h/x","method":1}`},
		{"headers", `{"type":"on_change","url":"http://h/x","headers":["a"]}`},
		{"headers", `{"type":"on_change","url":"http://h/x","headers":{"A":1}}`},
		{"headers", `{"type":"on_change","url":"http://h/x","headers":{"A B":"x"}}`},
		{"headers", `{"type":"on_change","url":"http://h/x","headers":{"A":"x\r\nB: y"}}`},
		{"since", `{"type":"on_change","url":"http://h/x","since":"yesterday"}`},
		{"if", `{"type":"on_change","url":"http://h/x","if":"x"}`},
		{"if", `{"type":"on_change","url":"http://h/x","if":{"a":1}}`},
		{"selector", `{"type":"on_change","url":"http://h/x","selector":[]}`},
		{"subject", `{"type":"on_change","subject":"a b"}`},
		{"subject", `{"type":"on_change","subject":"a.*"}`},
		{"subject", `{"type":"on_change","subject":"a.>"}`},
		{"subject", `{"type":"on_change","subject":"a..${db_name}"}`},
		{"subject", `{"type":"on_change","subject":"$JS.API.STREAM.PURGE.SPIEGEL_WORK"}`},
		{"subject", `{"type":"on_change","subject":"_INBOX.x"}`},
		{"subject", `{"type":"on_change","subject":"${db_name}.x"}`},
		{"timeout_ms", `{"type":"on_change","url":"http://h/x","timeout_ms":0}`},
		{"timeout_ms", `{"type":"on_change","url":"http://h/x","timeout_ms":1e13}`},
		{"retry", `{"type":"on_change","url":"http://h/x","retry":5}`},
		{"retry.backoff", `{"type":"on_change","url":"http://h/x","retry":{"backoff":"random"}}`},
		{"retry.backoff", `{"type":"on_change","url":"http://h/x","retry":{"backoff":null}}`},
		{"retry.delay_ms", `{"type":"on_change","url":"http://h/x","retry":{"delay_ms":-5}}`},
		{"retry.limit", `{"type":"on_change","url":"http://h/x","retry":{"limit":1.5}}`},
		{"retry.limit", `{"type":"on_change","url":"http://h/x","retry":{"limit":-1}}`},
		{"retry.multiplier", `{"type":"on_change","url":"http://h/x","retry":{"multiplier":0.5}}`},
		{"retry.tries", `{"type":"on_change","url":"http://h/x","retry":{"tries":5}}`},
		{"block", `{"type":"on_change","url":"http://h/x","block":"true"}`},
		{"debounce", `{"type":"on_change","url":"http://h/x","debounce":0}`},
		{"follow_redirects", `{"type":"on_change","url":"http://h/x","follow_redirects":1}`},
		{"signing", `{"type":"on_change","url":"http://h/x","signing":"hmac"}`},
		{"signing", `{"type":"on_change","url":"http://h/x","signing":"V1"}`},
		{"signing", `{"type":"on_change","url":"http://h/x","signing":"Standard"}`},
		{"signing", `{"type":"on_change","url":"http://h/x","signing":1}`},
		{"signing", `{"type":"on_change","url":"http://h/x","signing":["v1","standard"]}`},
	}
	for _, tt := range tests {
		t.Run(tt.field+" "+tt.doc, func(t *testing.T) {
			t.Parallel()
			_, err := Parse("bad-doc", []byte(tt.doc))
			var ve *ValidationError
			require.True(t, errors.As(err, &ve), "the parser must reject the doc, got %v", err)
			require.Equal(t, tt.field, ve.Field, "the parser's field")
			fields := schemaErrors(t, s, withID(t, tt.doc, "bad-doc"))
			require.NotEmpty(t, fields, "the schema accepts it")
			assert.True(t, about(fields, tt.field), "the schema's failures are about %v, not %q", fields, tt.field)
		})
	}
	// Docs the service ignores, which apply refuses: another type, a reserved id.
	for _, tt := range []struct{ field, id, doc string }{
		{"type", "r", `{"type":"on_chnage","url":"http://h/x"}`},
		{"type", "r", `{"source":"a","target":"b"}`},
		{"_id", "_design/x", `{"type":"replicator","source":"a","target":"b"}`},
		{"_id", "spiegel_cp_x", `{"type":"replicator","source":"a","target":"b"}`},
		{"_id", "spiegel_producer_seq", `{"type":"replicator","source":"a","target":"b"}`},
	} {
		_, err := Parse(tt.id, []byte(tt.doc))
		require.ErrorIs(t, err, ErrNotRule, tt.doc)
		assert.True(t, about(schemaErrors(t, s, withID(t, tt.doc, tt.id)), tt.field), "%s %s", tt.id, tt.doc)
	}
}

// The schema is never stricter than the parser: over docs made by setting one field of a valid
// doc to each of many values, valid and not, every doc the parser accepts validates.
func TestSchemaNeverRefusesWhatTheParserAccepts(t *testing.T) {
	t.Parallel()
	s := compileSchema(t)
	bases := []string{
		`{"type":"replicator","source":"db1","target":"db2"}`,
		`{"type":"replicator","db_name":"^u","source":"http://h/$db_name","target":"b"}`,
		`{"type":"on_change","url":"https://h/x"}`,
		`{"type":"on_change","subject":"a.${db_name}"}`,
		`{"type":"on_change","mirror":"docs"}`,
	}
	fieldNames := []string{"source", "target", "db_name", "disabled", "dirty_after_milliseconds", "engine", "url",
		"subject", "mirror", "method", "headers", "if", "selector", "since", "timeout_ms", "retry", "block", "debounce",
		"follow_redirects", "signing", "params", "filter", "source_proxy", "continuous"}
	values := []string{`null`, `""`, `" "`, `"x"`, `"POST"`, `"poſt"`, `"now"`, `"v1"`, `"standard"`, `"both"`, `"native"`, `"http://h/db"`,
		`"http://u:p@h/db"`, `"http://u:p/x@h/db"`, `"https://h:8080/p@x"`, `"HTTP://h/x"`, `"ftp://h/x"`, `"http://h"`,
		`"a.b"`, `"a..b"`, `"$JS.x"`, `"_INBOX.x"`, `"_INBOX${db_name}.x"`, `"${db_name}"`, `"a.${change.id}"`, `"docs"`,
		`"my.docs"`, `"^u"`, `"("`, `0`, `-1`, `1.5`, `3`, `1e13`, `true`, `false`, `[]`, `{}`, `{"a":"b"}`,
		`{"a":null}`, `{"a":1}`, `{"A B":"x"}`, `{"backoff":"linear"}`, `{"limit":2}`, `{"limit":1.5}`,
		`{"multiplier":0.5}`, `{"tries":1}`, `{"delay_ms":null}`, `{"backoff":null}`, `{"$gt":1}`}
	accepted := 0
	for _, base := range bases {
		for _, field := range fieldNames {
			for _, value := range values {
				var m map[string]json.RawMessage
				require.NoError(t, json.Unmarshal([]byte(base), &m))
				m[field] = json.RawMessage(value)
				doc, err := json.Marshal(m)
				require.NoError(t, err)
				if _, err := Parse("r", doc); err != nil {
					continue
				}
				accepted++
				assert.Empty(t, schemaErrors(t, s, withID(t, string(doc), "r")), "%s", doc)
			}
		}
	}
	assert.Greater(t, accepted, 1000, "the generated docs must exercise the schema")
}
