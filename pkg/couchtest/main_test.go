package couchtest

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Without COUCHDB_URL (and outside the test command), a package's CouchDB-backed tests skip and
// its TestMain says so in one line with their number and how to run them.
func TestMainReportsSkips(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run", "^TestCleanupPrefix$", "-test.v", "-test.count=1")
	env := []string{"COUCHDB_URL=", "SPIEGEL_REQUIRE_COUCHDB=", "CI="}
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "COUCHDB_URL" && k != "SPIEGEL_REQUIRE_COUCHDB" && k != "CI" {
			env = append(env, kv)
		}
	}
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Contains(t, string(out), "--- SKIP: TestCleanupPrefix")
	assert.Contains(t, string(out), "couchtest: 1 test(s) of ./pkg/couchtest skipped: COUCHDB_URL is unset. `make test` runs them")
	assert.Equal(t, 1, strings.Count(string(out), "couchtest: 1 test(s)"), "one line:\n%s", out)
}

// Every package whose tests use the test CouchDB reports its skips: its TestMain calls Main.
func TestEveryCouchDBPackageReportsSkips(t *testing.T) {
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	const mod = "github.com/spiegel-nats/spiegel/pkg/"
	users := map[string]bool{}     // dirs whose tests import couchtest or spiegeltest
	reporting := map[string]bool{} // dirs with a TestMain that calls Main
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if _, err := os.Stat(filepath.Join(path, "go.mod")); (err == nil && path != root) || d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".") && path != root {
				return filepath.SkipDir // another module, npm's tree, .git
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		dir := filepath.Dir(path)
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		require.NoError(t, err)
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if p == mod+"couchtest" || p == mod+"spiegeltest" {
				users[dir] = true
			}
		}
		src, err := os.ReadFile(path)
		require.NoError(t, err)
		if strings.Contains(string(src), "couchtest.Main(m)") || strings.Contains(string(src), "os.Exit(Main(m))") {
			reporting[dir] = true
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, users)
	for dir := range users {
		rel, _ := filepath.Rel(root, dir)
		assert.True(t, reporting[dir], "%s: its tests use the test CouchDB; add func TestMain(m *testing.M) { os.Exit(couchtest.Main(m)) }", rel)
	}
	assert.True(t, reporting[filepath.Join(root, "pkg", "couchtest")])
}
