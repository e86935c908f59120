package webhook

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/netip"
	"net/url"
	"strings"
	"testing"

	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// FuzzBuild builds requests from arbitrary docs, params and db names: it must never panic, a
// GET URL must parse with the db name landing escaped, and a POST body must be valid JSON.
func FuzzBuild(f *testing.F) {
	f.Add(`{"_id":"a","n":1}`, `{"change":"$change","db":"$db_name","x":[1,{"y":null}]}`, "db1", "GET")
	f.Add(`{"_id":"a/b?c","deep":{"a":[true,1e400]}}`, `{"d":"${change.doc}","s":"pre-${seq}-post"}`, "a+b$c(d)", "POST")
	f.Add(`null`, `"$change"`, "x", "DELETE")
	f.Add(`{"_id":"é\u0000"}`, `[1,"$change.id",{"":""}]`, "", "PUT")
	f.Fuzz(func(t *testing.T, docJSON, paramsJSON, db, method string) {
		dec := json.NewDecoder(bytes.NewReader([]byte(paramsJSON)))
		dec.UseNumber()
		var params any
		if dec.Decode(&params) != nil {
			return
		}
		var doc map[string]any
		dec = json.NewDecoder(bytes.NewReader([]byte(docJSON)))
		dec.UseNumber()
		_ = dec.Decode(&doc)
		m := map[string]string{"GET": "GET", "POST": "POST", "PUT": "PUT", "DELETE": "DELETE"}[method]
		if m == "" {
			m = "PATCH"
		}
		rule := &rules.OnChange{URL: "http://hook.example/${db_name}/x", Method: m, Params: params, Timeout: rules.DefaultTimeout}
		row := map[string]any{"seq": "1-x", "id": "id", "changes": []any{map[string]any{"rev": "1-a"}}, "doc": doc}
		req, err := Build(rule, rules.VarsFromChange(db, row))
		if err != nil {
			t.Fatalf("build: %v", err)
		}
		u, err := url.Parse(req.URL)
		if err != nil {
			t.Fatalf("URL %q does not parse: %v", req.URL, err)
		}
		if u.Host != "hook.example" {
			t.Fatalf("db name %q escaped into the host: %q", db, req.URL)
		}
		if want := "/" + db + "/x"; u.Path != want {
			t.Fatalf("path %q, want %q", u.Path, want)
		}
		if req.Body != nil && !json.Valid(req.Body) {
			t.Fatalf("body is not JSON: %q", req.Body)
		}
		_ = req.Key()
	})
}

// FuzzAddressCheck parses arbitrary allow-lists and checks arbitrary addresses: never a panic;
// an IPv4 address and its IPv4-mapped IPv6 form are judged alike; without a list the check is
// exactly "public or not"; a host the list names is allowed at any address.
func FuzzAddressCheck(f *testing.F) {
	f.Add("127.0.0.1,10.0.0.0/8,*.example", "hook.example", []byte{127, 0, 0, 1})
	f.Add("", "x", []byte{169, 254, 169, 254})
	f.Add("::1,[::1]:80,fd00::/8", "::1", []byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1})
	f.Add("h:80,/,::/0", "h", []byte{0x20, 0x02, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1})
	f.Fuzz(func(t *testing.T, list, host string, raw []byte) {
		var ip netip.Addr
		switch len(raw) {
		case 4:
			ip = netip.AddrFrom4([4]byte(raw))
		case 16:
			ip = netip.AddrFrom16([16]byte(raw))
		default:
			return
		}
		if ip.Is4() && nonPublic(ip) != nonPublic(netip.AddrFrom16(ip.As16())) {
			t.Fatalf("%s and its mapped form judged differently", ip)
		}
		a := parseAllowList(strings.Split(list, ","))
		err := a.policyFor(host, "80").check(ip)
		if !a.set() && (err != nil) != (nonPublic(ip) != "") {
			t.Fatalf("no list: %s refused=%v, non-public=%q", ip, err != nil, nonPublic(ip))
		}
		if a.named(host, "80") && err != nil {
			t.Fatalf("named host %q refused at %s: %v", host, ip, err)
		}
		if err != nil && !errors.Is(err, ErrAddressNotAllowed) {
			t.Fatalf("refusal does not match ErrAddressNotAllowed: %v", err)
		}
	})
}
