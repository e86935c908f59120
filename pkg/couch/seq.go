package couch

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// Seq is a CouchDB sequence value kept as an opaque string. CouchDB 2+ sends strings
// ("12-g1AAAA…"), PouchDB Server sends integers (12): both decode into a Seq holding the string's
// content or the number's literal text ("12"). Arrays and objects (BigCouch-era seqs) keep their
// compact JSON text. null decodes to "". A Seq is sent back to the server as it is (the `since`
// parameter) and otherwise compared only for equality. Equal seqs are one position; different
// ones may be too (CouchDB 2+ sends one state as different strings), so whether a db changed
// after a seq is asked of CouchDB (Client.ChangedSince), never read from the seqs.
type Seq string

// String returns the seq as sent back to the server.
func (s Seq) String() string { return string(s) }

// UnmarshalJSON implements json.Unmarshaler; see Seq.
func (s *Seq) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return fmt.Errorf("decode seq: empty value")
	}
	switch b[0] {
	case 'n':
		if string(b) != "null" {
			return fmt.Errorf("decode seq: invalid value %q", truncate(b, 40))
		}
		*s = ""
		return nil
	case '"':
		var str string
		if err := json.Unmarshal(b, &str); err != nil {
			return fmt.Errorf("decode seq: %w", err)
		}
		*s = Seq(str)
		return nil
	case '[', '{':
		var buf bytes.Buffer
		if err := json.Compact(&buf, b); err != nil {
			return fmt.Errorf("decode seq: %w", err)
		}
		*s = Seq(strings.ToValidUTF8(buf.String(), "\uFFFD"))
		return nil
	case 't', 'f':
		return fmt.Errorf("decode seq: boolean is not a sequence")
	default:
		var n json.Number
		if err := json.Unmarshal(b, &n); err != nil {
			return fmt.Errorf("decode seq: %w", err)
		}
		*s = Seq(n.String())
		return nil
	}
}

// truncate returns at most n bytes of b as a string, for error messages and logs.
func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "…"
}
