package rules

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"
)

func decodeNumbers(data []byte) (any, bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	return v, true
}

// FuzzParse: arbitrary bytes never panic; an invalid doc gives ErrNotRule or a ValidationError
// naming the id; a doc that parses, written back out from its compiled form, parses to the same
// rule.
func FuzzParse(f *testing.F) {
	for _, doc := range exampleDocs {
		f.Add("id", []byte(doc))
	}
	f.Add("x", []byte(`{"type":"replicator","source":"http://u:p@h/db","target":"b"}`))
	f.Add("x", []byte(`{"type":"on_change","subject":"a.${db_name}","retry":{"limit":3},"if":{"a":null}}`))
	f.Add("x", []byte(`{"type":"on_change","url":"http://h/x","selector":{"a":{"$elemMatch":{"$gt":1}}}}`))
	f.Add("x", []byte(`{"type":"on_change","url":"http://h/x","signing":"standard"}`))
	f.Fuzz(func(t *testing.T, id string, raw []byte) {
		r, err := Parse(id, raw)
		if err != nil {
			var ve *ValidationError
			if !errors.Is(err, ErrNotRule) && (!errors.As(err, &ve) || ve.DocID != id) {
				t.Fatalf("unexpected error %T %v", err, err)
			}
			return
		}
		r.MatchesDB(id)
		var again Rule
		switch x := r.(type) {
		case *Replicator:
			x.Resolve(id)
			doc := map[string]any{"type": KindReplicator, "source": x.Source, "target": x.Target,
				"disabled": x.Disabled, "dirty_after_milliseconds": float64(x.DirtyAfter) / float64(time.Millisecond), "engine": x.Engine}
			if x.Pattern != nil {
				doc["db_name"] = x.Pattern.String()
			}
			for k, v := range x.Params {
				doc[k] = v
			}
			again = mustReparse(t, x.ID(), doc)
			y := again.(*Replicator)
			if y.Source != x.Source || y.Target != x.Target || y.ExactDB != x.ExactDB || len(y.Params) != len(x.Params) ||
				y.Disabled != x.Disabled || y.Engine != x.Engine || (y.Pattern == nil) != (x.Pattern == nil) {
				t.Fatalf("replicator changed on re-parse: %+v vs %+v", x, y)
			}
		case *OnChange:
			x.MatchDoc(map[string]any{"a": 1.0})
			doc := map[string]any{"type": KindOnChange, "method": x.Method, "params": x.Params, "block": x.Block,
				"debounce": x.Debounce, "follow_redirects": x.FollowRedirects, "since": x.Since, "signing": x.Signing, "disabled": x.Disabled, "timeout_ms": x.Timeout.Milliseconds()}
			if x.Timeout.Milliseconds() == 0 {
				doc["timeout_ms"] = float64(x.Timeout) / float64(time.Millisecond)
			}
			if x.URL != "" {
				doc["url"] = x.URL
			} else {
				doc["subject"] = x.Subject
			}
			if x.DBPattern != nil {
				doc["db_name"] = x.DBPattern.String()
			}
			again = mustReparse(t, x.ID(), doc)
			y := again.(*OnChange)
			if y.URL != x.URL || y.Subject != x.Subject || y.Method != x.Method || y.Since != x.Since || y.FollowRedirects != x.FollowRedirects ||
				y.Signing != x.Signing {
				t.Fatalf("on_change changed on re-parse: %+v vs %+v", x, y)
			}
		}
	})
}

func mustReparse(t *testing.T, id string, doc map[string]any) Rule {
	t.Helper()
	raw, err := json.Marshal(doc)
	if err != nil {
		t.Fatalf("marshal: %v", err)
	}
	r, err := Parse(id, raw)
	if err != nil {
		t.Fatalf("re-parse of %s: %v", raw, err)
	}
	return r
}

// FuzzSubstitute: any JSON value substitutes without panicking into a value that still encodes,
// and Interpolate of any string with escaping leaves no unsafe byte from the values.
func FuzzSubstitute(f *testing.F) {
	f.Add([]byte(`{"a":"$change","b":["${db_name}",1,null,{"c":"x ${seq} $db_name"}]}`), "user/1", "3-x")
	f.Add([]byte(`"${change.doc}"`), "", "")
	f.Fuzz(func(t *testing.T, data []byte, db, seq string) {
		vars := VarsFromChange(db, map[string]any{"seq": seq, "id": db, "doc": map[string]any{"x": seq}})
		if v, ok := decodeNumbers(data); ok {
			out := Substitute(v, vars)
			if _, err := json.Marshal(out); err != nil {
				t.Fatalf("substituted value does not encode: %v", err)
			}
		}
		tmpl := string(data)
		got := Interpolate(tmpl, Vars{DBName: db, Seq: seq}, true)
		if !strings.Contains(tmpl, "$") && got != tmpl {
			t.Fatalf("template without tokens changed: %q → %q", tmpl, got)
		}
		if tmpl == "${db_name}" && got != escapeComponent(db) {
			t.Fatalf("escape: %q", got)
		}
		esc := escapeComponent(db)
		if dec, err := url.PathUnescape(esc); err != nil || dec != db {
			t.Fatalf("escape does not round-trip: %q → %q", db, esc)
		}
	})
}

// FuzzQueryString: any JSON value encodes to a query string url.ParseQuery accepts, made only
// of unreserved bytes, '%', '=' and '&'.
func FuzzQueryString(f *testing.F) {
	f.Add([]byte(`{"a":1,"b":{"c":"x"},"d":[1,2]}`))
	f.Add([]byte(`[null,true,{"é":"&="}]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		v, ok := decodeNumbers(data)
		if !ok {
			return
		}
		qs := QueryString(v)
		for i := 0; i < len(qs); i++ {
			if c := qs[i]; !isUnreserved(c) && c != '%' && c != '=' && c != '&' {
				t.Fatalf("unsafe byte %q in %q", c, qs)
			}
		}
		if _, err := url.ParseQuery(qs); err != nil {
			t.Fatalf("ParseQuery(%q): %v", qs, err)
		}
	})
}
