package mango

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func decodeJSON(t testing.TB, s string) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(s), &m), s)
	return m
}

const selectorDoc = `{"_id":"d1","name":"Alice","age":30,"score":7.5,"active":true,"nothing":null,
	"tags":["a","b","c"],"nums":[1,5,9],"addr":{"city":"Paris","zip":"75001","geo":{"lat":48.8}},
	"items":[{"k":"x","n":1},{"k":"y","n":2}],"empty":[],"dotted.key":1,"count":10}`

func TestSelector(t *testing.T) {
	t.Parallel()
	tests := []struct {
		sel  string
		want bool
	}{
		{`{}`, true},
		{`{"name":"Alice"}`, true},
		{`{"name":"alice"}`, false},
		{`{"name":"Alice","age":30}`, true},
		{`{"name":"Alice","age":31}`, false},
		{`{"age":30.0}`, true},
		{`{"addr":{"city":"Paris"}}`, true},
		{`{"addr":{"city":"Lyon"}}`, false},
		{`{"addr.city":"Paris"}`, true},
		{`{"addr.geo.lat":{"$gt":48}}`, true},
		{`{"addr":{"geo":{"lat":{"$lt":48}}}}`, false},
		{`{"dotted\\.key":1}`, true},
		{`{"items.1.k":"y"}`, true},
		{`{"items.5.k":"y"}`, false},
		{`{"tags":["a","b","c"]}`, true},
		{`{"tags":"a"}`, false},
		{`{"nothing":null}`, true},
		{`{"missing":null}`, false},
		{`{"age":{"$eq":30}}`, true},
		{`{"age":{"$ne":30}}`, false},
		{`{"age":{"$ne":31}}`, true},
		{`{"missing":{"$ne":1}}`, false},
		{`{"age":{"$gt":29,"$lt":31}}`, true},
		{`{"age":{"$gte":30,"$lte":30}}`, true},
		{`{"age":{"$gt":30}}`, false},
		{`{"name":{"$gt":"alice"}}`, true},
		{`{"name":{"$gt":"Alicf"}}`, false},
		{`{"name":{"$gt":99999}}`, true},
		{`{"age":{"$lt":"0"}}`, true},
		{`{"active":{"$gt":false}}`, true},
		{`{"nothing":{"$lt":false}}`, true},
		{`{"tags":{"$gt":"zzz"}}`, true},
		{`{"addr":{"$gt":["z"]}}`, true},
		{`{"age":{"$in":[1,30]}}`, true},
		{`{"age":{"$in":[1,2]}}`, false},
		{`{"tags":{"$in":["z","b"]}}`, true},
		{`{"age":{"$nin":[1,2]}}`, true},
		{`{"tags":{"$nin":["z","b"]}}`, false},
		{`{"missing":{"$nin":[1]}}`, false},
		{`{"nothing":{"$exists":true}}`, true},
		{`{"missing":{"$exists":false}}`, true},
		{`{"missing":{"$exists":true}}`, false},
		{`{"age":{"$exists":false}}`, false},
		{`{"name":{"$regex":"^Al"}}`, true},
		{`{"name":{"$regex":"^al"}}`, false},
		{`{"age":{"$regex":"3"}}`, false},
		{`{"name":{"$beginsWith":"Ali"}}`, true},
		{`{"$and":[{"age":30},{"name":"Alice"}]}`, true},
		{`{"$and":[{"age":30},{"name":"Bob"}]}`, false},
		{`{"$or":[{"age":1},{"name":"Alice"}]}`, true},
		{`{"$or":[{"age":1},{"name":"Bob"}]}`, false},
		{`{"$nor":[{"age":1},{"name":"Bob"}]}`, true},
		{`{"$nor":[{"age":30}]}`, false},
		{`{"$not":{"age":30}}`, false},
		{`{"age":{"$not":{"$eq":31}}}`, true},
		{`{"missing":{"$not":{"$eq":1}}}`, true},
		{`{"age":{"$or":[{"$lt":10},{"$gt":20}]}}`, true},
		{`{"nums":{"$elemMatch":{"$gt":8}}}`, true},
		{`{"nums":{"$elemMatch":{"$gt":9}}}`, false},
		{`{"items":{"$elemMatch":{"k":"y","n":2}}}`, true},
		{`{"items":{"$elemMatch":{"k":"y","n":1}}}`, false},
		{`{"empty":{"$elemMatch":{"$exists":true}}}`, false},
		{`{"nums":{"$allMatch":{"$gt":0}}}`, true},
		{`{"nums":{"$allMatch":{"$gt":1}}}`, false},
		{`{"empty":{"$allMatch":{"$gt":0}}}`, false},
		{`{"addr":{"$keyMapMatch":{"$eq":"zip"}}}`, true},
		{`{"addr":{"$keyMapMatch":{"$eq":"street"}}}`, false},
		{`{"tags":{"$size":3}}`, true},
		{`{"tags":{"$size":2}}`, false},
		{`{"name":{"$size":5}}`, false},
		{`{"tags":{"$all":["c","a"]}}`, true},
		{`{"tags":{"$all":["c","z"]}}`, false},
		{`{"tags":{"$all":[]}}`, false},
		{`{"name":{"$type":"string"}}`, true},
		{`{"age":{"$type":"number"}}`, true},
		{`{"active":{"$type":"boolean"}}`, true},
		{`{"nothing":{"$type":"null"}}`, true},
		{`{"tags":{"$type":"array"}}`, true},
		{`{"addr":{"$type":"object"}}`, true},
		{`{"addr":{"$type":"array"}}`, false},
		{`{"count":{"$mod":[3,1]}}`, true},
		{`{"count":{"$mod":[3,0]}}`, false},
		{`{"score":{"$mod":[2,1]}}`, false},
		{`{"name":{"$mod":[2,1]}}`, false},
	}
	doc := decodeJSON(t, selectorDoc)
	var numDoc map[string]any
	dec := json.NewDecoder(strings.NewReader(selectorDoc))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&numDoc))
	for _, tt := range tests {
		t.Run(tt.sel, func(t *testing.T) {
			t.Parallel()
			s, err := Compile(decodeJSON(t, tt.sel))
			require.NoError(t, err)
			assert.Equal(t, tt.want, s.Match(doc), "float64 doc")
			assert.Equal(t, tt.want, s.Match(numDoc), "json.Number doc")
			assert.Equal(t, tt.want, s.MatchRaw([]byte(selectorDoc)), "raw doc")
		})
	}
}

func TestSelectorCompileErrors(t *testing.T) {
	t.Parallel()
	for sel, want := range map[string]string{
		`{"a":{"$foo":1}}`:           "unknown operator $foo",
		`{"$where":"x"}`:             "unknown operator $where",
		`{"$and":{"a":1}}`:           "$and",
		`{"$or":[1]}`:                "$or",
		`{"a":{"$in":1}}`:            "$in",
		`{"a":{"$exists":1}}`:        "$exists",
		`{"a":{"$type":"date"}}`:     "$type",
		`{"a":{"$regex":"("}}`:       "$regex",
		`{"a":{"$regex":1}}`:         "$regex",
		`{"a":{"$size":-1}}`:         "$size",
		`{"a":{"$mod":[0,1]}}`:       "$mod",
		`{"a":{"$mod":[2]}}`:         "$mod",
		`{"a":{"$elemMatch":1}}`:     "$elemMatch",
		`{"a":{"$not":[]}}`:          "$not",
		`{"a":{"b":{"$bad":true}}}`:  "$bad",
		`{"a":{"$beginsWith":true}}`: "$beginsWith",
	} {
		_, err := Compile(decodeJSON(t, sel))
		require.Error(t, err, sel)
		assert.Contains(t, err.Error(), want, sel)
	}
}

func TestSelectorMatchRawInvalid(t *testing.T) {
	t.Parallel()
	s, err := Compile(map[string]any{})
	require.NoError(t, err)
	assert.False(t, s.MatchRaw([]byte(`[1]`)))
	assert.False(t, s.MatchRaw([]byte(`{`)))
	assert.False(t, s.MatchRaw([]byte(`null`)))
	assert.True(t, s.MatchRaw([]byte(`{}`)))
	assert.True(t, s.Match(nil))
}

func TestCollate(t *testing.T) {
	t.Parallel()
	// CouchDB's documented view collation order, as far as this package implements it.
	ordered := []string{`null`, `false`, `true`, `-1`, `0`, `1.5`, `2`, `10`, `"a"`, `"A"`, `"aa"`,
		`"b"`, `"B"`, `"ba"`, `[]`, `["a"]`, `["b"]`, `["b","c"]`, `{}`, `{"a":1}`, `{"a":2}`, `{"b":1}`}
	vals := make([]any, len(ordered))
	for i, s := range ordered {
		require.NoError(t, json.Unmarshal([]byte(s), &vals[i]))
	}
	for i := range vals {
		for j := range vals {
			want := 0
			if i < j {
				want = -1
			} else if i > j {
				want = 1
			}
			assert.Equal(t, want, collate(vals[i], vals[j]), "%s vs %s", ordered[i], ordered[j])
		}
	}
	assert.Equal(t, 0, collate(json.Number("3"), 3.0))
	assert.Equal(t, -1, collate(json.Number("9007199254740992"), json.Number("9007199254740993")))
}
