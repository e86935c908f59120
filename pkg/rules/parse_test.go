package rules

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Rule docs from the original Spiegel's design docs (seeds 000, 001) and SPEC §2, made valid
// JSON (comments and placeholders replaced by values).
var exampleDocs = map[string]string{
	"seed000 replicator": `{"type":"replicator","source":"https://user@db.example.com:6984/db1",
		"target":"https://user@db2.example.com:6984/db1","filter":"app/by_type",
		"query_params":{"type":"post"},"dirty":true,"updated_at":"2018-01-01T00:00:00Z","locked_at":null}`,
	"seed000 on_change": `{"type":"on_change","db_name":"^user_","if":{"type":"^post$","author":"bob"},
		"url":"https://user@api.example.com","params":{"foo":"bar","change":"$change","db_name":"$db_name"},
		"method":"POST","block":true,"debounce":true}`,
	"seed001 replicator": `{"type":"replicator","source":"https://user@db.example.com/a","target":"https://user@db.example.com/b",
		"filter":"f","query_params":"x"}`,
	"seed001 on_change lower-case method": `{"type":"on_change","db_name":"dbname1|dbname2","url":"https://user@api.example.com/x",
		"params":{"foo":"bar","changes":"${changes}"},"method":"post","block":false,"debounce":true}`,
	"spec replicator": `{"type":"replicator","source":"http://user@couch.example:5984/db1",
		"target":"https://user@other-region:6984/db1","db_name":"^user_","filter":"...","query_params":{},
		"doc_ids":[],"selector":{},"create_target":false,"dirty_after_milliseconds":0,"disabled":false}`,
	"spec on_change url": `{"type":"on_change","db_name":"^user_","if":{"type":"^post$","archived":null},
		"selector":{"status":{"$in":["new"]}},"url":"https://api.example/hook/${db_name}","method":"POST",
		"params":{"change":"$change","db":"$db_name"},"headers":{"X-Token":"..."},"block":false,
		"debounce":false,"since":"beginning","disabled":false}`,
	"spec on_change subject": `{"type":"on_change","db_name":"^user_","subject":"couch.changes.${db_name}","since":"now"}`,
	"bare names":             `{"type":"replicator","source":"db1","target":"db1_backup"}`,
}

func TestParseExamples(t *testing.T) {
	t.Parallel()
	for name, doc := range exampleDocs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r, err := Parse("doc1", []byte(doc))
			require.NoError(t, err)
			assert.Equal(t, "doc1", r.ID())
			assert.True(t, r.Enabled())
		})
	}
}

func TestParseReplicator(t *testing.T) {
	t.Parallel()
	r, err := Parse("", []byte(`{"_id":"r1","_rev":"3-abc","_conflicts":["2-x"],"type":"replicator",
		"source":"http://u@h:5984/a%2Fb%2Bc%24d","target":"backup","continuous":true,"cancel":false,
		"create_target":true,"since_seq":12345678901234567890,"dirty":true,"locked_at":"x","updated_at":"y",
		"dirty_at":"z","retries":3,"possibly_deleted_at":null,"dirty_after_milliseconds":1500,"engine":"native"}`))
	require.NoError(t, err)
	rep := r.(*Replicator)
	assert.Equal(t, "r1", rep.ID())
	assert.Equal(t, "3-abc", rep.Rev())
	assert.Equal(t, KindReplicator, rep.Kind())
	assert.Equal(t, events.GroupReplicate, rep.Group())
	assert.Equal(t, "a/b+c$d", rep.ExactDB)
	assert.Nil(t, rep.Pattern)
	assert.Equal(t, 1500*time.Millisecond, rep.DirtyAfter)
	assert.Equal(t, EngineNative, rep.Engine)
	assert.Equal(t, map[string]any{"create_target": true, "since_seq": json.Number("12345678901234567890")}, rep.Params)
	assert.True(t, rep.MatchesDB("a/b+c$d"))
	assert.False(t, rep.MatchesDB("a%2Fb%2Bc%24d"))
	src, tgt := rep.Resolve("ignored")
	assert.Equal(t, "http://u@h:5984/a%2Fb%2Bc%24d", src)
	assert.Equal(t, "backup", tgt)
}

func TestExactDB(t *testing.T) {
	t.Parallel()
	for source, want := range map[string]string{
		"db1":                           "db1",
		"http://h:5984/db1":             "db1",
		"http://h:5984/db1/":            "db1",
		"http://h/prefix/couch/db1?x=1": "db1",
		"http://u@h:5984/a%2Fb%2Bc%24d": "a/b+c$d",
		"https://h/%28x%29":             "(x)",
	} {
		got, err := exactDBName(source)
		require.NoError(t, err, source)
		assert.Equal(t, want, got, source)
	}
	for _, source := range []string{"http://h:5984", "http://h:5984/", "http://h/%zz"} {
		_, err := exactDBName(source)
		assert.Error(t, err, source)
	}
}

func TestResolvePattern(t *testing.T) {
	t.Parallel()
	r, err := Parse("p", []byte(`{"type":"replicator","db_name":"^user_","source":"$db_name",
		"target":"https://u@backup:6984/bk_${db_name}"}`))
	require.NoError(t, err)
	rep := r.(*Replicator)
	assert.True(t, rep.MatchesDB("user_a/b+c$d(1)"))
	assert.False(t, rep.MatchesDB("x_user_1"), "anchored by ^")
	src, tgt := rep.Resolve("user_a/b+c$d(1) é")
	assert.Equal(t, "user_a/b+c$d(1) é", src)
	assert.Equal(t, "https://u@backup:6984/bk_user_a%2Fb%2Bc%24d%281%29%20%C3%A9", tgt)

	r, err = Parse("p2", []byte(`{"type":"replicator","db_name":"^u","source":"http://h/$db_name",
		"target":"http://h/$seq$change_${db_name}"}`))
	require.NoError(t, err)
	src, tgt = r.(*Replicator).Resolve("u$1")
	assert.Equal(t, "http://h/u%241", src)
	assert.Equal(t, "http://h/$seq$change_u%241", tgt, "only db_name tokens are replaced")
}

func TestParseOnChange(t *testing.T) {
	t.Parallel()
	r, err := Parse("oc", []byte(exampleDocs["spec on_change url"]))
	require.NoError(t, err)
	oc := r.(*OnChange)
	assert.Equal(t, events.GroupOnChange, oc.Group())
	assert.Equal(t, "POST", oc.Method)
	assert.Equal(t, SinceBeginning, oc.Since)
	assert.Equal(t, DefaultTimeout, oc.Timeout)
	assert.Equal(t, DefaultRetryPolicy(), oc.Retry)
	assert.Equal(t, map[string]string{"X-Token": "..."}, oc.Headers)
	assert.False(t, oc.FollowRedirects, "redirects are not followed unless the rule says so")
	assert.Equal(t, SigningV1, oc.Signing, "requests are signed the v1 way unless the rule says otherwise")
	require.Contains(t, oc.If, "archived")
	assert.Nil(t, oc.If["archived"])
	assert.True(t, oc.MatchesDB("user_1"))
	assert.False(t, oc.MatchesDB("admin"))

	r, err = Parse("oc2", []byte(`{"type":"on_change","subject":"a.b","timeout_ms":250,
		"retry":{"backoff":"linear","delay_ms":500,"multiplier":3,"limit":0,"max_delay_ms":2000}}`))
	require.NoError(t, err)
	oc = r.(*OnChange)
	assert.Nil(t, oc.DBPattern)
	assert.True(t, oc.MatchesDB("anything"))
	assert.Equal(t, "GET", oc.Method)
	assert.Equal(t, 250*time.Millisecond, oc.Timeout)
	assert.Equal(t, RetryPolicy{Backoff: BackoffLinear, BaseDelay: 500 * time.Millisecond, Multiplier: 3, Limit: 0, MaxDelay: 2 * time.Second}, oc.Retry)

	r, err = Parse("oc3", []byte(`{"type":"on_change","url":"http://h/x","follow_redirects":true}`))
	require.NoError(t, err)
	assert.True(t, r.(*OnChange).FollowRedirects)

	for _, signing := range []string{SigningV1, SigningStandard, SigningBoth} {
		r, err = Parse("oc-"+signing, []byte(`{"type":"on_change","url":"http://h/x","signing":"`+signing+`"}`))
		require.NoError(t, err)
		assert.Equal(t, signing, r.(*OnChange).Signing)
	}
	for _, unset := range []string{`null`, `""`} {
		r, err = Parse("oc-unset", []byte(`{"type":"on_change","url":"http://h/x","signing":`+unset+`}`))
		require.NoError(t, err)
		assert.Equal(t, SigningV1, r.(*OnChange).Signing, "signing %s", unset)
	}

	r, err = Parse("oc4", []byte(`{"type":"on_change","db_name":"^orders","mirror":"ORDERS_STATE"}`))
	require.NoError(t, err)
	oc = r.(*OnChange)
	assert.Equal(t, "ORDERS_STATE", oc.Mirror)
	assert.Empty(t, oc.URL+oc.Subject)
}

func TestMatchDoc(t *testing.T) {
	t.Parallel()
	r, err := Parse("oc", []byte(`{"type":"on_change","url":"http://h/x",
		"if":{"type":"^post$","archived":null,"n":"^4[0-9]$","flag":"true"},"selector":{"status":"new"}}`))
	require.NoError(t, err)
	oc := r.(*OnChange)
	base := func() map[string]any {
		return map[string]any{"type": "post", "n": json.Number("42"), "flag": true, "status": "new"}
	}
	tests := []struct {
		name string
		edit func(map[string]any)
		want bool
	}{
		{"all hold", func(map[string]any) {}, true},
		{"null counts as absent", func(d map[string]any) { d["archived"] = nil }, true},
		{"present field fails null", func(d map[string]any) { d["archived"] = false }, false},
		{"regex mismatch", func(d map[string]any) { d["type"] = "comment" }, false},
		{"regex on absent field fails", func(d map[string]any) { delete(d, "type") }, false},
		{"regex on null field fails", func(d map[string]any) { d["type"] = nil }, false},
		{"float64 number as text", func(d map[string]any) { d["n"] = 43.0 }, true},
		{"number out of regex", func(d map[string]any) { d["n"] = 50.0 }, false},
		{"bool as text", func(d map[string]any) { d["flag"] = false }, false},
		{"selector fails", func(d map[string]any) { d["status"] = "old" }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			d := base()
			tt.edit(d)
			assert.Equal(t, tt.want, oc.MatchDoc(d))
		})
	}
}

func TestParseNotRule(t *testing.T) {
	t.Parallel()
	cases := map[string][2]string{
		"design doc":      {"_design/validate", `{"type":"replicator","source":"a","target":"b"}`},
		"local doc":       {"_local/x", `{}`},
		"checkpoint":      {"spiegel_cp_rule_db", `{"last_seq":"1-x"}`},
		"producer seq":    {"spiegel_producer_seq", `{"last_seq":"1-x"}`},
		"no type":         {"x", `{"source":"a"}`},
		"other type":      {"spiegel_cl_db1", `{"type":"change_listener","db_name":"db1"}`},
		"non-string type": {"x", `{"type":3}`},
		"deleted":         {"x", `{"_id":"x","_rev":"2-a","_deleted":true}`},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse(c[0], []byte(c[1]))
			assert.ErrorIs(t, err, ErrNotRule)
		})
	}
}

func TestParseInvalid(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-pw"
	tests := []struct {
		name, doc, field string
		reason           string // substring of the error
	}{
		{"bad json", `{"type":`, "", "invalid JSON"},
		{"not an object", `[1]`, "", "not a JSON object"},
		{"no source", `{"type":"replicator","target":"b"}`, "source", "required"},
		{"source not string", `{"type":"replicator","source":{"url":"x"},"target":"b"}`, "source", "string"},
		{"no target", `{"type":"replicator","source":"a"}`, "target", "required"},
		{"source without db", `{"type":"replicator","source":"http://h:5984/","target":"b"}`, "source", "name a database"},
		{"password in source", `{"type":"replicator","source":"http://u:` + secret + `@h/db","target":"b"}`, "source", "password in URL"},
		{"password in target", `{"type":"replicator","source":"a","target":"https://u:` + secret + `@h/db"}`, "target", "password in URL"},
		{"password with slash", `{"type":"replicator","source":"a","target":"https://u:` + secret + `/x@h/db"}`, "target", "password in URL"},
		{"password in param", `{"type":"replicator","source":"a","target":"b","source_proxy":"http://u:` + secret + `@p:3128"}`, "source_proxy", "password in URL"},
		{"password in url", `{"type":"on_change","url":"https://u:` + secret + `@api/x"}`, "url", "password in URL"},
		{"bad regex", `{"type":"replicator","db_name":"user_(","source":"$db_name","target":"b"}`, "db_name", "missing closing )"},
		{"db_name not string", `{"type":"replicator","db_name":3,"source":"a","target":"b"}`, "db_name", "string"},
		{"token in exact source", `{"type":"replicator","source":"http://h/$db_name","target":"b"}`, "source", "db_name pattern"},
		{"disabled not bool", `{"type":"replicator","source":"a","target":"b","disabled":"yes"}`, "disabled", "true or false"},
		{"negative dirty_after", `{"type":"replicator","source":"a","target":"b","dirty_after_milliseconds":-1}`, "dirty_after_milliseconds", "non-negative"},
		{"dirty_after string", `{"type":"replicator","source":"a","target":"b","dirty_after_milliseconds":"5"}`, "dirty_after_milliseconds", "number"},
		{"bad engine", `{"type":"replicator","source":"a","target":"b","engine":"rsync"}`, "engine", "native"},
		{"no url nor subject", `{"type":"on_change"}`, "url", "one of url, subject and mirror"},
		{"url and mirror", `{"type":"on_change","url":"http://h/x","mirror":"docs"}`, "mirror", "only one"},
		{"subject and mirror", `{"type":"on_change","subject":"a.b","mirror":"docs"}`, "mirror", "only one"},
		{"mirror not a bucket name", `{"type":"on_change","mirror":"my.docs"}`, "mirror", "not a NATS KV bucket name"},
		{"mirror not string", `{"type":"on_change","mirror":true}`, "mirror", "string"},
		{"url and subject", `{"type":"on_change","url":"http://h/x","subject":"a.b"}`, "subject", "only one"},
		{"relative url", `{"type":"on_change","url":"/hook"}`, "url", "absolute http"},
		{"ftp url", `{"type":"on_change","url":"ftp://h/x"}`, "url", "absolute http"},
		{"bad method", `{"type":"on_change","url":"http://h/x","method":"HEAD"}`, "method", "GET, POST"},
		{"method not string", `{"type":"on_change","url":"http://h/x","method":1}`, "method", "string"},
		{"headers not object", `{"type":"on_change","url":"http://h/x","headers":["a"]}`, "headers", "object"},
		{"header value number", `{"type":"on_change","url":"http://h/x","headers":{"A":1}}`, "headers", "must be a string"},
		{"header bad name", `{"type":"on_change","url":"http://h/x","headers":{"A B":"x"}}`, "headers", "invalid header name"},
		{"bad since", `{"type":"on_change","url":"http://h/x","since":"yesterday"}`, "since", "beginning"},
		{"if not object", `{"type":"on_change","url":"http://h/x","if":"x"}`, "if", "object"},
		{"if value number", `{"type":"on_change","url":"http://h/x","if":{"a":1}}`, "if", "regex string or null"},
		{"if bad regex", `{"type":"on_change","url":"http://h/x","if":{"a":"("}}`, "if", "missing closing )"},
		{"selector not object", `{"type":"on_change","url":"http://h/x","selector":[]}`, "selector", "object"},
		{"selector bad operator", `{"type":"on_change","url":"http://h/x","selector":{"a":{"$foo":1}}}`, "selector", "unknown operator $foo"},
		{"subject with space", `{"type":"on_change","subject":"a b"}`, "subject", "whitespace"},
		{"subject wildcard", `{"type":"on_change","subject":"a.*"}`, "subject", "wildcards"},
		{"subject empty token", `{"type":"on_change","subject":"a..${db_name}"}`, "subject", "empty token"},
		{"timeout zero", `{"type":"on_change","url":"http://h/x","timeout_ms":0}`, "timeout_ms", "positive"},
		{"retry not object", `{"type":"on_change","url":"http://h/x","retry":5}`, "retry", "object"},
		{"retry bad backoff", `{"type":"on_change","url":"http://h/x","retry":{"backoff":"random"}}`, "retry.backoff", "linear"},
		{"retry bad limit", `{"type":"on_change","url":"http://h/x","retry":{"limit":1.5}}`, "retry.limit", "integer"},
		{"retry bad multiplier", `{"type":"on_change","url":"http://h/x","retry":{"multiplier":0.5}}`, "retry.multiplier", "≥ 1"},
		{"retry unknown key", `{"type":"on_change","url":"http://h/x","retry":{"tries":5}}`, "retry.tries", "unknown key"},
		{"block not bool", `{"type":"on_change","url":"http://h/x","block":"true"}`, "block", "true or false"},
		{"follow_redirects not bool", `{"type":"on_change","url":"http://h/x","follow_redirects":1}`, "follow_redirects", "true or false"},
		{"unknown signing", `{"type":"on_change","url":"http://h/x","signing":"hmac-sha256"}`, "signing", `must be "v1", "standard" or "both"`},
		{"signing in capitals", `{"type":"on_change","url":"http://h/x","signing":"BOTH"}`, "signing", `must be "v1", "standard" or "both"`},
		{"signing not string", `{"type":"on_change","url":"http://h/x","signing":true}`, "signing", "must be a string"},
		{"subject into the work queue", `{"type":"on_change","subject":"spiegel.work.onchange.x"}`, "subject", "service's own subjects"},
		{"subject into JetStream's API", `{"type":"on_change","subject":"$JS.API.STREAM.PURGE.SPIEGEL_WORK"}`, "subject", "NATS system subject"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse("bad-doc", []byte(tt.doc))
			var ve *ValidationError
			require.True(t, errors.As(err, &ve), "want a ValidationError, got %v", err)
			assert.Equal(t, "bad-doc", ve.DocID)
			assert.Equal(t, tt.field, ve.Field)
			assert.Contains(t, err.Error(), tt.reason)
			assert.Contains(t, err.Error(), `rule "bad-doc"`)
			assert.NotContains(t, err.Error(), secret)
		})
	}
}

func TestHasPassword(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{
		"http://u:p@h/db":            true,
		"http://u:@h/db":             true,
		"http://u:p@ss@h/db":         true,
		"http://u:pa/ss@h/db":        true,
		"http://u@h:5984/db":         false,
		"http://h:5984/db?e=a@b":     false,
		"http://h/db?e=a:b@c":        false,
		"db_name_with_colon:x@y":     false,
		"https://h:5984/db#frag@x:y": false,
	} {
		assert.Equal(t, want, hasPassword(s), s)
	}
}

func TestRetryDelay(t *testing.T) {
	t.Parallel()
	exp := RetryPolicy{Backoff: BackoffExponential, BaseDelay: time.Second, Multiplier: 2, MaxDelay: time.Minute}
	lin := RetryPolicy{Backoff: BackoffLinear, BaseDelay: 500 * time.Millisecond, Multiplier: 2}
	for _, tt := range []struct {
		p       RetryPolicy
		attempt int
		want    time.Duration
	}{
		{exp, 0, time.Second}, {exp, 1, time.Second}, {exp, 2, 2 * time.Second}, {exp, 4, 8 * time.Second},
		{exp, 7, time.Minute}, {exp, 5000, time.Minute},
		{lin, 1, 500 * time.Millisecond}, {lin, 3, 1500 * time.Millisecond},
	} {
		assert.Equal(t, tt.want, tt.p.Delay(tt.attempt), "%s attempt %d", tt.p.Backoff, tt.attempt)
	}
	assert.False(t, RetryPolicy{Limit: 0}.GiveUp(1000))
	assert.False(t, RetryPolicy{Limit: 3}.GiveUp(2))
	assert.True(t, RetryPolicy{Limit: 3}.GiveUp(3))
	assert.Positive(t, RetryPolicy{BaseDelay: time.Hour, Multiplier: 10}.Delay(1000))
}

func TestValidationErrorText(t *testing.T) {
	t.Parallel()
	assert.Equal(t, `rule "x": field "url": bad`, (&ValidationError{DocID: "x", Field: "url", Reason: "bad"}).Error())
	assert.Equal(t, `rule "x": bad`, (&ValidationError{DocID: "x", Reason: "bad"}).Error())
	assert.False(t, strings.Contains((&ValidationError{DocID: "x"}).Error(), "field"))
}
