package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The committed references must be what the code generates: a variable or a metric added,
// renamed or redescribed without `go run ./scripts/confdoc` fails here.
func TestReferencesAreCurrent(t *testing.T) {
	t.Parallel()
	secs, err := sections()
	require.NoError(t, err)
	for _, s := range secs {
		_, committed, err := s.committed("../..")
		require.NoError(t, err)
		assert.Equal(t, s.text, committed, "%s: the %s reference is stale: run `go run ./scripts/confdoc` from the repository root", s.file, s.name)
	}
}

// The metrics reference lists what every binary registers, with the type and labels the
// collectors give, and nothing of the Go runtime's collectors.
func TestMetricsReferenceListsTheCollectors(t *testing.T) {
	t.Parallel()
	ref, err := metricsReference()
	require.NoError(t, err)
	for _, want := range []string{
		"| `spiegel_jobs_published_total` | counter | `group` | producer |",
		"| `spiegel_job_duration_seconds` | histogram | `group` | replicator, onchange |",
		"| `spiegel_jobs_pending` | gauge | `group` | all |",
		"| `spiegel_ready` | gauge | `check` | all |",
		"| `spiegel_build_info` | gauge | `version`, `component` | all |",
	} {
		assert.Contains(t, ref, want)
	}
	assert.NotContains(t, ref, "go_goroutines")
	assert.NotContains(t, ref, "process_")
	for _, l := range strings.Split(ref, "\n") {
		assert.NotContains(t, strings.ToLower(strings.SplitN(l+"||||", "|", 5)[3]), "db", "no label may carry a db name: %s", l)
	}
}

// A run rewrites a stale section in place and leaves the rest of the page as it was; a check
// reports it and writes nothing.
func TestRunRewritesOnlyBetweenMarkers(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	secs, err := sections()
	require.NoError(t, err)
	for _, s := range secs {
		begin, end := s.markers()
		require.NoError(t, os.MkdirAll(filepath.Join(root, filepath.Dir(s.file)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, s.file), []byte("# Page\n\nbefore\n"+begin+"old\n"+end+"\nafter\n"), 0o644))
	}
	require.Error(t, run(root, true), "a stale page fails the check")
	require.NoError(t, run(root, false))
	require.NoError(t, run(root, true), "the rewritten pages are current")
	for _, s := range secs {
		b, err := os.ReadFile(filepath.Join(root, s.file))
		require.NoError(t, err)
		begin, end := s.markers()
		assert.Equal(t, "# Page\n\nbefore\n"+begin+s.text+end+"\nafter\n", string(b))
	}
}
