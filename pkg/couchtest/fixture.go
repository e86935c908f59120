package couchtest

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// The recorded fixture sets: one folder of NAME.http exchanges per server version. The same
// names hold the same exchange in every set (see pkg/couchtest/testdata/README.md).
const (
	// CouchDB33 is Apache CouchDB 3.3.3, single node, q=2, in the shared folder beside the
	// repository (../shared/fixtures/couchdb-3.3).
	CouchDB33 = "couchdb-3.3"
	// CouchDB35 is Apache CouchDB 3.5.2, single node, q=2 n=1 (pkg/couchtest/testdata).
	CouchDB35 = "couchdb-3.5"
	// CouchDB35Cluster is a three-node Apache CouchDB 3.5.2 cluster, q=2 n=3
	// (pkg/couchtest/testdata).
	CouchDB35Cluster = "couchdb-3.5-cluster"
)

// FixtureSets returns every fixture set, oldest version first: the table of version-driven
// fixture tests.
func FixtureSets() []string { return []string{CouchDB33, CouchDB35, CouchDB35Cluster} }

// Recorded is one exchange recorded from a real server (see FixtureSets): what PouchDB Server
// cannot produce.
type Recorded struct {
	Request     []string // the "> " lines: method and path, then the JSON body if any
	Status      int
	ContentType string
	Body        []byte // the answer's body, byte for byte
}

// Lines returns the body's lines that are not blank, without the line end and the "," that
// separates the rows of a normal feed: the single lines a continuous feed would send, for the
// seed corpus of the line parsers' fuzz targets.
func (r Recorded) Lines() [][]byte {
	var out [][]byte
	for line := range bytes.SplitSeq(r.Body, []byte("\n")) {
		line = bytes.TrimSuffix(bytes.TrimSpace(line), []byte(","))
		if len(line) > 0 {
			out = append(out, line)
		}
	}
	return out
}

// repoRoot returns the repository's root above the working directory.
func repoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatalf("couchtest: working directory: %v", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			if _, err := os.Stat(filepath.Join(dir, "producer")); err == nil {
				return dir // the repository root, not a nested module
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("couchtest: repository root not found above the working directory")
		}
		dir = parent
	}
}

// FixtureDir returns the folder of the CouchDB 3.3 exchanges (FixtureSetDir of CouchDB33).
func FixtureDir(t testing.TB) string {
	t.Helper()
	return FixtureSetDir(t, CouchDB33)
}

// FixtureSetDir returns the folder of the fixture set named set (one of FixtureSets). The sets
// in the repository are always there: a missing one fails the test. The CouchDB 3.3 set lives
// in the shared folder beside the repository; when it is missing the test is skipped, except
// under CI=true, where it fails: CI checks the repository out with the shared folder beside it,
// so a missing folder means tests that must run did not.
func FixtureSetDir(t testing.TB, set string) string {
	t.Helper()
	root := repoRoot(t)
	switch set {
	case CouchDB33:
		fixtures := filepath.Join(root, "..", "shared", "fixtures", set)
		if _, err := os.Stat(fixtures); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("couchtest: the CouchDB 3.3 fixtures are missing (%v): check out ../shared beside the repository", err)
			}
			t.Skipf("couchtest: the CouchDB 3.3 fixtures are missing (%v)", err)
		}
		return fixtures
	case CouchDB35, CouchDB35Cluster:
		fixtures := filepath.Join(root, "pkg", "couchtest", "testdata", set)
		if _, err := os.Stat(fixtures); err != nil {
			t.Fatalf("couchtest: fixture set %s: %v", set, err)
		}
		return fixtures
	default:
		t.Fatalf("couchtest: unknown fixture set %q (want one of %v)", set, FixtureSets())
		return ""
	}
}

// Fixture reads the CouchDB 3.3 exchange name (FixtureFrom of CouchDB33).
func Fixture(t testing.TB, name string) Recorded {
	t.Helper()
	return FixtureFrom(t, CouchDB33, name)
}

// FixtureFrom reads the recorded exchange name ("changes-normal" or "changes-normal.http") of
// the fixture set named set; see FixtureSetDir for a missing folder. A missing or malformed
// file fails the test.
func FixtureFrom(t testing.TB, set, name string) Recorded {
	t.Helper()
	if !strings.HasSuffix(name, ".http") {
		name += ".http"
	}
	data, err := os.ReadFile(filepath.Join(FixtureSetDir(t, set), name))
	if err != nil {
		t.Fatalf("couchtest: fixture %s/%s: %v", set, name, err)
	}
	rec, err := ParseRecorded(data)
	if err != nil {
		t.Fatalf("couchtest: fixture %s/%s: %v", set, name, err)
	}
	return rec
}

// ParseRecorded decodes one NAME.http file: "> " request lines, "< " status and Content-Type
// lines, a blank line, then the body byte for byte.
func ParseRecorded(data []byte) (Recorded, error) {
	var rec Recorded
	r := bufio.NewReader(bytes.NewReader(data))
	offset := 0
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return Recorded{}, fmt.Errorf("ends inside its header")
		}
		offset += len(line)
		text := strings.TrimSuffix(line, "\n")
		switch {
		case strings.HasPrefix(text, "> "):
			rec.Request = append(rec.Request, strings.TrimPrefix(text, "> "))
		case strings.HasPrefix(text, "< HTTP/"):
			f := strings.Fields(text)
			if len(f) < 3 {
				return Recorded{}, fmt.Errorf("status line %q has no status", text)
			}
			status, err := strconv.Atoi(f[2])
			if err != nil || status < 100 || status > 599 {
				return Recorded{}, fmt.Errorf("status line %q: bad status", text)
			}
			rec.Status = status
		case strings.HasPrefix(text, "< Content-Type: "):
			rec.ContentType = strings.TrimPrefix(text, "< Content-Type: ")
		case text == "":
			if rec.Status == 0 {
				return Recorded{}, fmt.Errorf("no status line")
			}
			rec.Body = data[offset:]
			return rec, nil
		default:
			return Recorded{}, fmt.Errorf("unexpected header line %q", text)
		}
	}
}
