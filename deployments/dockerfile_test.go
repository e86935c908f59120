package deployments

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// instruction is one Dockerfile instruction: its keyword (upper case) and its arguments.
type instruction struct {
	Cmd, Args string
	Line      int
}

// parseDockerfile is a small parser of the Dockerfile syntax this repository uses: comments,
// parser directives, and backslash line continuations (comment lines inside a continuation are
// dropped, as Docker does). Heredocs are not supported and are not used.
func parseDockerfile(t *testing.T, file string) []instruction {
	t.Helper()
	data, err := os.ReadFile(file)
	require.NoError(t, err)
	var out []instruction
	var cur strings.Builder
	start := 0
	for i, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") || (trimmed == "" && cur.Len() == 0) {
			continue
		}
		if cur.Len() == 0 {
			start = i + 1
		}
		if strings.HasSuffix(trimmed, "\\") {
			cur.WriteString(strings.TrimSuffix(trimmed, "\\") + " ")
			continue
		}
		cur.WriteString(trimmed)
		cmd, args, _ := strings.Cut(strings.TrimSpace(cur.String()), " ")
		out = append(out, instruction{Cmd: strings.ToUpper(cmd), Args: strings.TrimSpace(args), Line: start})
		cur.Reset()
	}
	require.Zero(t, cur.Len(), "Dockerfile ends inside a line continuation")
	return out
}

func TestDockerfile(t *testing.T) {
	t.Parallel()
	ins := parseDockerfile(t, "Dockerfile")
	known := map[string]bool{"FROM": true, "RUN": true, "CMD": true, "LABEL": true, "EXPOSE": true, "ENV": true,
		"ADD": true, "COPY": true, "ENTRYPOINT": true, "VOLUME": true, "USER": true, "WORKDIR": true, "ARG": true,
		"ONBUILD": true, "STOPSIGNAL": true, "HEALTHCHECK": true, "SHELL": true}
	// Stages, with the global ARGs (before the first FROM) substituted into FROM lines.
	type stage struct {
		from, name string
		ins        []instruction
	}
	globals := map[string]string{}
	var stages []*stage
	for _, in := range ins {
		require.True(t, known[in.Cmd], "line %d: unknown instruction %s", in.Line, in.Cmd)
		switch {
		case in.Cmd == "ARG" && len(stages) == 0:
			k, v, _ := strings.Cut(in.Args, "=")
			globals[k] = v
		case in.Cmd == "FROM":
			f := strings.Fields(in.Args)
			from := os.Expand(f[0], func(k string) string { return globals[k] })
			s := &stage{from: from}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				s.name = f[2]
			}
			stages = append(stages, s)
		default:
			require.NotEmpty(t, stages, "line %d: %s before FROM", in.Line, in.Cmd)
			stages[len(stages)-1].ins = append(stages[len(stages)-1].ins, in)
		}
	}
	require.GreaterOrEqual(t, len(stages), 2, "multi-stage build")
	build, final := stages[0], stages[len(stages)-1]
	assert.Regexp(t, `^golang:1\.26(\.\d+)?$`, build.from, "builder: golang 1.26 (go.mod's toolchain)")
	require.NotEmpty(t, build.name)
	assert.Regexp(t, `^gcr\.io/distroless/static(-debian\d+)?:nonroot$`, final.from, "final stage: distroless static, nonroot")

	// The builder: static binaries of the three commands, version stamped into pkg/config.Version.
	text := func(s *stage, cmd string) string {
		var b strings.Builder
		for _, in := range s.ins {
			if in.Cmd == cmd {
				b.WriteString(in.Args + "\n")
			}
		}
		return b.String()
	}
	assert.Regexp(t, `(^|\s)CGO_ENABLED=0(\s|$)`, text(build, "ENV"))
	run := text(build, "RUN")
	require.Contains(t, run, "go build")
	assert.Contains(t, run, "-trimpath")
	assert.Regexp(t, `-ldflags "-s -w [^"]*"`, run)
	cfgPkg := reflect.TypeOf(config.Producer{}).PkgPath()
	assert.Contains(t, run, "-X "+cfgPkg+".Version=${VERSION}", "the version variable lives in %s", cfgPkg)
	_ = config.Version // the variable the flag sets
	for _, pkg := range []string{"./producer", "./consumers/replicator", "./consumers/onchange"} {
		assert.Contains(t, run, " "+pkg, "go build %s", pkg)
		assertMainPackage(t, filepath.Join("..", pkg))
	}

	// The final stage: the three binaries, a non-root user, the three HTTP ports, no secrets.
	copies := text(final, "COPY")
	for _, bin := range binaries {
		assert.Regexp(t, `--from=`+regexp.QuoteMeta(build.name)+` .*/out/`+bin+`( |\n)`, copies)
	}
	assert.Regexp(t, `/usr/local/bin/\n?$`, copies, "binaries are copied to /usr/local/bin/")
	user := strings.TrimSpace(text(final, "USER"))
	require.NotEmpty(t, user, "the image sets a USER")
	u, _, _ := strings.Cut(user, ":")
	assert.NotContains(t, []string{"root", "0"}, u, "USER must not be root")
	expose := strings.Fields(text(final, "EXPOSE"))
	for _, bin := range binaries {
		assert.Contains(t, expose, itoa(defaultPort(t, bin)), "EXPOSE the default port of %s", bin)
	}
	secretish := regexp.MustCompile(`(?i)password|secret|token|couchdb_url|nkey|creds`)
	for _, s := range stages {
		for _, in := range s.ins {
			if in.Cmd == "ENV" || in.Cmd == "ARG" {
				assert.NotRegexp(t, secretish, in.Args, "line %d: no secret in the image", in.Line)
			}
		}
	}
	assert.Empty(t, text(final, "ENV"), "configuration comes from the environment at run time")

	// The Dockerfile-specific ignore file sits beside it, where BuildKit looks for it.
	ignore, err := os.ReadFile("Dockerfile.dockerignore")
	require.NoError(t, err)
	assert.Contains(t, string(ignore), ".git")
	assert.NotRegexp(t, `(?m)^\*\*?/?\*\.go$`, string(ignore), "Go sources must reach the build")
}

func assertMainPackage(t *testing.T, dir string) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	require.NoError(t, err)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		if regexp.MustCompile(`(?m)^package main$`).Match(data) {
			return
		}
	}
	t.Errorf("%s is not a main package", dir)
}
