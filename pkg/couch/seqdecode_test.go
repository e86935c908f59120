package couch

import (
	"bytes"
	"encoding/base64"
	"reflect"
	"strings"
	"testing"
)

// BenchmarkSeqCompare is what an on_change job spends on its seqs: FilesReplaced, Packed and
// SameCopies over a CouchDB 3.3 checkpoint seq and a page's last_seq.
func BenchmarkSeqCompare(b *testing.B) {
	a, c := Seq(couch333Info), Seq(couch333Changes)
	for b.Loop() {
		_ = FilesReplaced(a, c)
		_ = Packed(a)
		_ = SameCopies(a, c)
	}
}

// The zlib readers that decode packed seqs are reused: one that read a corrupt seq is not, and a
// reused one decodes as a new one does.
func TestInflateReuse(t *testing.T) {
	want, err := unpackSeq(couch333Changes)
	if err != nil {
		t.Fatal(err)
	}
	num, packed, _ := strings.Cut(couch333Changes, "-")
	raw, err := base64.RawURLEncoding.DecodeString(packed)
	if err != nil {
		t.Fatal(err)
	}
	for i := 7; i < len(raw); i++ { // past the version, tag and size: the zlib stream
		bad := bytes.Clone(raw)
		bad[i] ^= 0x5a
		if _, err := unpackSeq(Seq(num + "-" + base64.RawURLEncoding.EncodeToString(bad))); err == nil {
			continue // a flip the term decoder accepts still has to leave the reader clean
		}
		got, err := unpackSeq(couch333Changes)
		if err != nil {
			t.Fatalf("after a corrupt seq (byte %d): %v", i, err)
		}
		if !reflect.DeepEqual(want, got) {
			t.Fatalf("after a corrupt seq (byte %d): decoded %v, want %v", i, got, want)
		}
	}
	for _, s := range []Seq{couch333Info, couch333Limit2, couch333Changes} {
		fresh, err := unpackSeq(s)
		if err != nil {
			t.Fatal(err)
		}
		again, err := unpackSeq(s)
		if err != nil || !reflect.DeepEqual(fresh, again) {
			t.Fatalf("%s decoded twice: %v, %v (%v)", s, fresh, again, err)
		}
	}
}
