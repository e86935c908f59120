package couchtest

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var (
	skipped         atomic.Int64 // tests Get skipped because COUCHDB_URL is unset
	markUncacheable sync.Once
)

// skip counts a test Get skips and, the first time, makes the run uncacheable: it must happen
// while the tests run, for the go command records the files a test binary opens only then.
func skip() {
	skipped.Add(1)
	markUncacheable.Do(uncacheable)
}

// Main runs the tests of a package that uses the server (call it from TestMain:
// os.Exit(couchtest.Main(m))) and returns m.Run's exit code. When tests were skipped because
// COUCHDB_URL is unset, it prints one line saying how many, in which package, and how to run
// them: a plain `go test ./...` must not look green while the CouchDB-backed tests did not run.
//
// The go command shows a passing package's output only with -v, so without -v the line goes to
// the terminal (/dev/tty) when there is one, else to stderr. It would also replay a cached pass
// without the line: such a run opens a file of the module it has just written, which makes the
// go command not cache it, so the line is printed, and the tests run, every time until
// COUCHDB_URL is set.
func Main(m *testing.M) int {
	code := m.Run()
	if n := skipped.Load(); n > 0 {
		line := fmt.Sprintf("couchtest: %d test(s) of %s skipped: COUCHDB_URL is unset. `make test` runs them against a PouchDB Server it starts (or set COUCHDB_URL=http://admin:pw@host:5984)",
			n, packageDir())
		reportSkips(line)
	}
	return code
}

// reportSkips prints line where the person running the tests sees it.
func reportSkips(line string) {
	var w io.Writer = os.Stderr
	if testing.Verbose() {
		w = os.Stdout
	} else if tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0); err == nil {
		defer tty.Close()
		w = tty
	}
	fmt.Fprintln(w, line)
}

// uncacheable writes a file in the module root and opens it: the go command caches no test run
// that opened a file of the module modified within the last seconds. (.couchtest-skipped is in
// .gitignore.)
func uncacheable() {
	root := moduleRoot()
	if root == "" {
		return
	}
	// One file for every package, rewritten by each: it must still exist when the go command
	// looks at it after the run.
	name := filepath.Join(root, ".couchtest-skipped")
	if err := os.WriteFile(name, []byte(time.Now().String()+"\n"), 0o644); err != nil {
		return
	}
	if f, err := os.Open(name); err == nil {
		_ = f.Close()
	}
}

// moduleRoot returns the directory of the go.mod above the working directory (the go command
// runs a test binary in its package's directory), or "".
func moduleRoot() string {
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// packageDir returns the test's package directory relative to the module root, or its name.
func packageDir() string {
	wd, err := os.Getwd()
	if err != nil {
		return "this package"
	}
	if root := moduleRoot(); root != "" {
		if rel, err := filepath.Rel(root, wd); err == nil {
			return "./" + filepath.ToSlash(rel)
		}
	}
	return filepath.Base(wd)
}
