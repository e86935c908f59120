package config

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Build is what a binary knows about its build: the version (Version when the Makefile set it,
// else the module's version, else "dev"), and from the Go toolchain's build info the commit, its
// time, whether the work tree had uncommitted changes, and the Go version.
type Build struct {
	Version    string `json:"version"`
	Commit     string `json:"commit,omitempty"`
	CommitTime string `json:"commit_time,omitempty"`
	Dirty      bool   `json:"dirty"`
	GoVersion  string `json:"go_version"`
}

// ReadBuild returns the build of the running binary.
func ReadBuild() Build {
	bi, ok := debug.ReadBuildInfo()
	return buildOf(Version, bi, ok)
}

// buildOf is ReadBuild over given values: version is the -ldflags one ("dev" when unset).
func buildOf(version string, bi *debug.BuildInfo, ok bool) Build {
	b := Build{Version: version, GoVersion: runtime.Version()}
	if !ok || bi == nil {
		return b
	}
	if bi.GoVersion != "" {
		b.GoVersion = bi.GoVersion
	}
	if v := bi.Main.Version; (b.Version == "" || b.Version == "dev") && v != "" && v != "(devel)" {
		b.Version = v
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Commit = s.Value
		case "vcs.time":
			b.CommitTime = s.Value
		case "vcs.modified":
			b.Dirty = s.Value == "true"
		}
	}
	if b.Version == "" {
		b.Version = "dev"
	}
	return b
}

// String is the build in one line, e.g. "v1.4.0 (commit 1a2b3c4d5e6f, 2026-01-02T03:04:05Z,
// dirty) go1.26.8".
func (b Build) String() string {
	var parts []string
	if b.Commit != "" {
		parts = append(parts, "commit "+shortCommit(b.Commit))
	}
	if b.CommitTime != "" {
		parts = append(parts, b.CommitTime)
	}
	if b.Dirty {
		parts = append(parts, "dirty")
	}
	s := b.Version
	if len(parts) > 0 {
		s += " (" + strings.Join(parts, ", ") + ")"
	}
	return fmt.Sprintf("%s %s", s, b.GoVersion)
}

func shortCommit(c string) string {
	if len(c) > 12 {
		return c[:12]
	}
	return c
}
