package mirrorkey

import (
	"regexp"
	"strings"
	"testing"
)

// validKey is the NATS KV key syntax (nats.go's own check): allowed characters, no empty
// token, no leading or trailing dot.
var validKey = regexp.MustCompile(`^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$`)

func TestRoundTrip(t *testing.T) {
	for _, c := range [][2]string{
		{"db", "doc"}, {"", ""}, {"a/b$c(d)+e-f", "_design/x"}, {"orders", "with.dot and space"},
		{"ünïcødé", "\x00\xff"}, {"a", "="}, {"a.b", ".."},
	} {
		k := Encode(c[0], c[1])
		if !validKey.MatchString(k) {
			t.Fatalf("Encode(%q, %q) = %q: not a valid KV key", c[0], c[1], k)
		}
		db, id, err := Decode(k)
		if err != nil || db != c[0] || id != c[1] {
			t.Fatalf("Decode(%q) = %q, %q, %v; want %q, %q", k, db, id, err, c[0], c[1])
		}
	}
	if got := Encode("db", "doc"); got != "ZGI.ZG9j" {
		t.Fatalf("Encode(db, doc) = %q, want ZGI.ZG9j (the documented format)", got)
	}
}

func TestDecodeRefuses(t *testing.T) {
	for _, k := range []string{"", "abc", "ZGI.", ".ZG9j", "ZGI.ZG9j.x", "ZGI=.ZG9j", "ZGJ.ZG9j", "Z.ZG9j"} {
		if _, _, err := Decode(k); err == nil {
			t.Errorf("Decode(%q) accepted a key Encode never writes", k)
		}
	}
}

func TestDBPrefix(t *testing.T) {
	if got := DBPrefix("db"); got != "ZGI.*" {
		t.Fatalf("DBPrefix(db) = %q", got)
	}
}

// FuzzRoundTrip: every db name and doc id gives a valid KV key that decodes back to them, and
// every key Decode accepts is Encode's output for what it decoded to.
func FuzzRoundTrip(f *testing.F) {
	f.Add("db", "doc")
	f.Add("", "")
	f.Add("a.b", "_design/=x")
	f.Fuzz(func(t *testing.T, db, id string) {
		k := Encode(db, id)
		if !validKey.MatchString(k) {
			t.Fatalf("Encode(%q, %q) = %q: not a valid KV key", db, id, k)
		}
		gdb, gid, err := Decode(k)
		if err != nil || gdb != db || gid != id {
			t.Fatalf("Decode(%q) = %q, %q, %v", k, gdb, gid, err)
		}
		// The db's fence is a valid key that is no doc's key and that no db's filter matches.
		fk := Fence(db)
		if !validKey.MatchString(fk) {
			t.Fatalf("Fence(%q) = %q: not a valid KV key", db, fk)
		}
		if _, _, err := Decode(fk); err == nil {
			t.Fatalf("Decode(Fence(%q)) = %q accepted as a doc key", db, fk)
		}
		if strings.Count(fk, ".") == 1 {
			t.Fatalf("Fence(%q) = %q has the two tokens of a doc key (DBPrefix matches those)", db, fk)
		}
	})
}

// FuzzDecode: Decode never panics, and a key it accepts is exactly Encode's output.
func FuzzDecode(f *testing.F) {
	f.Add("ZGI.ZG9j")
	f.Add("=.=")
	f.Add("ZGJ.ZG9j")
	f.Fuzz(func(t *testing.T, k string) {
		db, id, err := Decode(k)
		if err != nil {
			return
		}
		if Encode(db, id) != k {
			t.Fatalf("Decode(%q) = %q, %q but Encode gives %q", k, db, id, Encode(db, id))
		}
	})
}
