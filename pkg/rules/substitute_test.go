package rules

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testVars(t testing.TB) Vars {
	change := decodeJSON(t, `{"seq":"12-abc","id":"doc/1","changes":[{"rev":"2-x"}],
		"doc":{"_id":"doc/1","_rev":"2-x","n":5,"title":"hi & bye"}}`)
	return VarsFromChange("user_a/b+c", change)
}

func TestVarsFromChange(t *testing.T) {
	t.Parallel()
	v := testVars(t)
	assert.Equal(t, "user_a/b+c", v.DBName)
	assert.Equal(t, "12-abc", v.Seq)
	assert.Equal(t, "doc/1", v.ChangeID)
	assert.Equal(t, "2-x", v.ChangeRev)
	assert.Equal(t, "hi & bye", v.Doc["title"])

	pouch := VarsFromChange("db", map[string]any{"seq": json.Number("42"), "id": "x", "doc": map[string]any{"_rev": "1-a"}})
	assert.Equal(t, "42", pouch.Seq)
	assert.Equal(t, "1-a", pouch.ChangeRev)
}

func TestSubstitute(t *testing.T) {
	t.Parallel()
	v := testVars(t)
	params := decodeJSON(t, `{"change":"$change","doc":"${change.doc}","id":"$change.id","rev":"${change.rev}",
		"db":"$db_name","seq":"$seq","n":42,"f":1.5,"b":true,"z":null,"text":"db=${db_name} id=${change.id}",
		"bare":"db=$db_name","unknown":"$nope","unknown2":"${nope}","list":["$db_name",{"deep":"${seq}"}],
		"json":"doc:${change.doc}","$db_name":"key stays","dollar":"$","open":"${db_name"}`)
	got := Substitute(params, v).(map[string]any)
	assert.Equal(t, v.Change, got["change"])
	assert.Equal(t, v.Doc, got["doc"])
	assert.Equal(t, "doc/1", got["id"])
	assert.Equal(t, "2-x", got["rev"])
	assert.Equal(t, "user_a/b+c", got["db"])
	assert.Equal(t, "12-abc", got["seq"])
	assert.Equal(t, 42.0, got["n"])
	assert.Equal(t, 1.5, got["f"])
	assert.Equal(t, true, got["b"])
	assert.Nil(t, got["z"])
	assert.Contains(t, got, "z")
	assert.Equal(t, "db=user_a/b+c id=doc/1", got["text"])
	assert.Equal(t, "db=$db_name", got["bare"], "bare tokens only replace whole strings")
	assert.Equal(t, "$nope", got["unknown"])
	assert.Equal(t, "${nope}", got["unknown2"])
	assert.Equal(t, []any{"user_a/b+c", map[string]any{"deep": "12-abc"}}, got["list"])
	assert.JSONEq(t, `{"_id":"doc/1","_rev":"2-x","n":5,"title":"hi & bye"}`, got["json"].(string)[4:])
	assert.Equal(t, "key stays", got["$db_name"])
	assert.Equal(t, "$", got["dollar"])
	assert.Equal(t, "${db_name", got["open"])

	// Deep copy: editing the result leaves the params alone.
	got["list"].([]any)[0] = "changed"
	assert.Equal(t, "$db_name", params["list"].([]any)[0])

	// Scalars and json.Number pass through.
	assert.Equal(t, json.Number("7"), Substitute(json.Number("7"), v))
	assert.Nil(t, Substitute(nil, v))
	assert.Equal(t, "user_a/b+c", Substitute("$db_name", v))
	assert.Nil(t, Substitute("$change.doc", Vars{}), "no doc → null")
}

func decodeJSON(t testing.TB, s string) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(s), &m), s)
	return m
}

func TestInterpolate(t *testing.T) {
	t.Parallel()
	v := testVars(t)
	tests := []struct {
		tmpl   string
		escape bool
		want   string
	}{
		{"https://api/hook/${db_name}", true, "https://api/hook/user_a%2Fb%2Bc"},
		{"https://api/hook/$db_name/x", true, "https://api/hook/user_a%2Fb%2Bc/x"},
		{"https://api/hook?db=$db_name&id=${change.id}&s=$seq", true, "https://api/hook?db=user_a%2Fb%2Bc&id=doc%2F1&s=12-abc"},
		{"https://api/$db_names", true, "https://api/$db_names"},
		{"https://api/$change.foo", true, "https://api/$change.foo"},
		{"https://api/${unknown}/$x", true, "https://api/${unknown}/$x"},
		{"couch.changes.${db_name}", false, "couch.changes.user_a/b+c"},
		{"${change.rev}:$change.id", false, "2-x:doc/1"},
		{"no tokens", true, "no tokens"},
		{"x$", true, "x$"},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, Interpolate(tt.tmpl, v, tt.escape), tt.tmpl)
	}
	assert.Contains(t, Interpolate("$change", v, true), "%7B%22changes%22")
}

func TestQueryString(t *testing.T) {
	t.Parallel()
	tests := []struct {
		params string
		want   string
	}{
		{`{"a":1,"b":{"c":"x"},"d":[1,2]}`, "a=1&b%5Bc%5D=x&d%5B0%5D=1&d%5B1%5D=2"},
		{`{"a":null,"b":true,"c":false}`, "a=&b=true&c=false"},
		{`{"s":"a b&c=d/é+(x)"}`, "s=a%20b%26c%3Dd%2F%C3%A9%2B%28x%29"},
		{`{"n":1.5,"big":12345678901234567890,"e":1e21,"small":1e-7,"neg":-0}`, "big=12345678901234567890&e=1e%2B21&n=1.5&neg=0&small=1e-7"},
		{`{"o":{"p":[{"q":1}]}}`, "o%5Bp%5D%5B0%5D%5Bq%5D=1"},
		{`{"empty":{},"list":[],"k":"v"}`, "k=v"},
		{`{}`, ""},
		{`{"a b":"c"}`, "a%20b=c"},
	}
	for _, tt := range tests {
		var m any
		dec := json.NewDecoder(strings.NewReader(tt.params))
		dec.UseNumber()
		require.NoError(t, dec.Decode(&m))
		assert.Equal(t, tt.want, QueryString(m), tt.params)
	}
	assert.Equal(t, "a=1&b=0.1", QueryString(map[string]any{"a": 1.0, "b": 0.1}), "float64 numbers")
	assert.Equal(t, "0=x&1=y", QueryString([]any{"x", "y"}))
	assert.Equal(t, "", QueryString("scalar"))
	assert.Equal(t, "", QueryString(nil))
}
