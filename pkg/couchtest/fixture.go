package couchtest

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Recorded is one exchange recorded from Apache CouchDB 3.3.3 in the shared fixtures folder
// (../shared/fixtures/couchdb-3.3 beside the repository): what PouchDB Server cannot produce.
type Recorded struct {
	Request     []string // the "> " lines: method and path, then the JSON body if any
	Status      int
	ContentType string
	Body        []byte // the answer's body, byte for byte
}

// FixtureDir returns the folder of the recorded exchanges. When it is missing the test is
// skipped, except under CI=true, where it fails: CI checks the repository out with the shared
// folder beside it, so a missing folder means tests that must run did not.
func FixtureDir(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatalf("couchtest: working directory: %v", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			if _, err := os.Stat(filepath.Join(dir, "producer")); err == nil {
				break // the repository root, not a nested module
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("couchtest: repository root not found above the working directory")
		}
		dir = parent
	}
	fixtures := filepath.Join(dir, "..", "shared", "fixtures", "couchdb-3.3")
	if _, err := os.Stat(fixtures); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("couchtest: the CouchDB 3.3 fixtures are missing (%v): check out ../shared beside the repository", err)
		}
		t.Skipf("couchtest: the CouchDB 3.3 fixtures are missing (%v)", err)
	}
	return fixtures
}

// Fixture reads the recorded exchange name ("changes-normal" or "changes-normal.http"), see
// FixtureDir for a missing folder. A missing or malformed file fails the test.
func Fixture(t testing.TB, name string) Recorded {
	t.Helper()
	if !strings.HasSuffix(name, ".http") {
		name += ".http"
	}
	data, err := os.ReadFile(filepath.Join(FixtureDir(t), name))
	if err != nil {
		t.Fatalf("couchtest: fixture %s: %v", name, err)
	}
	var rec Recorded
	r := bufio.NewReader(bytes.NewReader(data))
	offset := 0
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("couchtest: fixture %s ends inside its header", name)
		}
		offset += len(line)
		text := strings.TrimSuffix(line, "\n")
		switch {
		case strings.HasPrefix(text, "> "):
			rec.Request = append(rec.Request, strings.TrimPrefix(text, "> "))
		case strings.HasPrefix(text, "< HTTP/"):
			if f := strings.Fields(text); len(f) >= 3 {
				rec.Status, _ = strconv.Atoi(f[2])
			}
		case strings.HasPrefix(text, "< Content-Type: "):
			rec.ContentType = strings.TrimPrefix(text, "< Content-Type: ")
		case text == "":
			if rec.Status == 0 {
				t.Fatalf("couchtest: fixture %s has no status line", name)
			}
			rec.Body = data[offset:]
			return rec
		default:
			t.Fatalf("couchtest: fixture %s: unexpected header line %q", name, text)
		}
	}
}
