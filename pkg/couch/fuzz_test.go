package couch

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

var fuzzSeeds = []string{
	`{"db_name":"a","type":"created","seq":"1-x"}`,
	`{"last_seq":"5-x"}`,
	`{"seq":3,"id":"updated:db","changes":[{"rev":"1-a"}]}`,
	`{"seq":"1","id":"d","changes":[{"rev":"1-a"}],"deleted":true,"doc":{"_id":"d"}}`,
	`{"error":"x","reason":"y"}`,
	`null`, `[]`, `"s"`, `{"seq":[1,"a"]}`, `{"seq":1e400}`, "\xff\xfe", ``,
}

// addFixtureSeeds adds fuzzSeeds and every line of the feeds recorded from CouchDB 3.5.2 (single
// node and cluster: their seqs differ in length and shape from 3.3's) to f's seed corpus.
func addFixtureSeeds(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add([]byte(s))
	}
	for _, set := range []string{couchtest.CouchDB35, couchtest.CouchDB35Cluster} {
		for _, name := range []string{"db-updates-continuous-live", "db-updates-normal", "db-updates-longpoll",
			"global-changes", "changes-continuous", "changes-normal", "changes-longpoll-empty", "get-db-missing"} {
			for _, line := range couchtest.FixtureFrom(f, set, name).Lines() {
				f.Add(line)
			}
		}
	}
}

func FuzzParseDBUpdateLine(f *testing.F) {
	addFixtureSeeds(f)
	f.Fuzz(func(t *testing.T, line []byte) {
		ev, seq, ok, err := parseDBUpdateLine(line)
		if err != nil && ok {
			t.Fatal("an error and an event")
		}
		if ok && (ev.DB == "" || ev.Seq != seq) {
			t.Fatalf("bad event %+v seq %q", ev, seq)
		}
	})
}

func FuzzParseGlobalChangesLine(f *testing.F) {
	addFixtureSeeds(f)
	f.Fuzz(func(t *testing.T, line []byte) {
		ev, _, ok, err := parseGlobalChangesLine(line)
		if err != nil && ok {
			t.Fatal("an error and an event")
		}
		if ok && (ev.DB == "" || ev.Type == "") {
			t.Fatalf("bad event %+v", ev)
		}
	})
}

func FuzzParseChangeLine(f *testing.F) {
	addFixtureSeeds(f)
	f.Fuzz(func(t *testing.T, line []byte) {
		ch, seq, ok, err := parseChangeLine(line)
		if err != nil && ok {
			t.Fatal("an error and a change")
		}
		if ok && (ch.ID == "" || ch.Seq == "" || ch.Seq != seq) {
			t.Fatalf("bad change %+v", ch)
		}
	})
}

// FuzzSeq checks that any decoded seq re-encodes as a JSON string and survives a round trip.
func FuzzSeq(f *testing.F) {
	for _, s := range []string{`"1-x"`, `3`, `null`, `[1,"a"]`, `-0.5e-3`, `{"a":1}`} {
		f.Add([]byte(s))
	}
	for _, set := range []string{couchtest.CouchDB35, couchtest.CouchDB35Cluster} {
		var page struct {
			LastSeq json.RawMessage `json:"last_seq"`
		}
		if err := json.Unmarshal(couchtest.FixtureFrom(f, set, "changes-normal").Body, &page); err != nil {
			f.Fatal(err)
		}
		f.Add([]byte(page.LastSeq))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var s Seq
		if json.Unmarshal(data, &s) != nil {
			return
		}
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		var back Seq
		if err := json.Unmarshal(b, &back); err != nil || back != s {
			t.Fatalf("round trip of %q: %q, %v", s, back, err)
		}
	})
}

func FuzzReadLines(f *testing.F) {
	f.Add([]byte("a\n\nb\r\nc"), 4)
	f.Add([]byte("\n\n\n"), 1)
	f.Fuzz(func(t *testing.T, data []byte, maxLen int) {
		if maxLen < 1 || maxLen > 1<<16 {
			return
		}
		err := readLines(bytes.NewReader(data), maxLen, func(l []byte) error {
			if len(l) == 0 || len(l) > maxLen || bytes.ContainsRune(l, '\n') {
				t.Fatalf("bad line %q", l)
			}
			return nil
		}, nil)
		if err != nil {
			t.Fatal(err)
		}
	})
}
