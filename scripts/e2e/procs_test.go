package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/logtest"
)

// repoRoot returns the repository root (this package is scripts/e2e) and skips the test when a
// binary of bin/ is missing: the test command builds them with `make build` before `go test`.
func repoRoot(t testing.TB, bins ...string) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatalf("repo root: %v", err)
	}
	for _, b := range bins {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Skipf("bin/%s is missing: the test command builds it (make build)", b)
		}
	}
	return root
}

// baseEnv is the test's environment without any SPIEGEL_ variable, plus the allow-list of the
// tests' webhook receivers (httptest servers on 127.0.0.1, refused by default), plus extra.
func baseEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SPIEGEL_") {
			env = append(env, kv)
		}
	}
	env = append(env, "SPIEGEL_WEBHOOK_ALLOWED_HOSTS=127.0.0.1")
	return append(env, extra...)
}

// syncBuffer captures logs while they are written.
type syncBuffer = logtest.Buffer

// proc is a long-running binary started by the test.
type proc struct {
	name string
	addr string // SPIEGEL_HTTP_ADDR
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error // set when done is closed
}

// startProc starts bin with env; it is killed when the test ends if it is still running.
func startProc(t testing.TB, name, bin, addr string, env []string) *proc {
	t.Helper()
	p := &proc{name: name, addr: addr, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(bin)
	p.cmd.Env = env
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s output (tail):\n%s", name, tail(p.out.String(), 25))
		}
		if dir := os.Getenv("BENCH_PROC_LOG_DIR"); dir != "" { // a bench's process logs, to study a run
			_ = os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s-%d.log", name, p.cmd.Process.Pid)), []byte(p.out.String()), 0o644)
		}
	})
	return p
}

// running reports whether the process has not exited.
func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// signal sends sig to the process.
func (p *proc) signal(t testing.TB, sig os.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %s to %s: %v", sig, p.name, err)
	}
}

// stop sends SIGTERM and waits up to within for the exit; it returns the exit error (nil for
// status 0), or an error saying the process did not stop (it is then killed).
func (p *proc) stop(within time.Duration) error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.err
	case <-time.After(within):
		_ = p.cmd.Process.Kill()
		<-p.done
		return errors.New(p.name + " did not stop within " + within.String() + " of SIGTERM")
	}
}

// get returns the status and body of GET http://<p.addr><path> ("" and 0 on no answer).
func (p *proc) get(path string) (int, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.addr+path, nil)
	if err != nil {
		return 0, ""
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// runCmd runs bin args... with env to completion (bounded by 30s) and returns its combined
// output and exit code (-1 when it could not run or was killed).
func runCmd(t testing.TB, bin string, env []string, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &ee) && ee.ExitCode() >= 0:
		return string(out), ee.ExitCode()
	default:
		return string(out) + "\n(" + err.Error() + ")", -1
	}
}

// runCmdIO runs bin args... with env and stdin to completion (bounded by 30s) and returns its
// stdout, its stderr and its exit code (-1 when it could not run or was killed).
func runCmdIO(t testing.TB, bin string, env []string, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env, cmd.Stdin = env, strings.NewReader(stdin)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return out.String(), errOut.String(), 0
	case errors.As(err, &ee) && ee.ExitCode() >= 0:
		return out.String(), errOut.String(), ee.ExitCode()
	default:
		return out.String(), errOut.String() + "\n(" + err.Error() + ")", -1
	}
}

// waitFor polls cond every 100ms until it holds; it fails the test when within passes or when
// one of procs exits meanwhile.
func waitFor(t testing.TB, within time.Duration, what string, procs []*proc, cond func() bool) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(within)
	defer func() { t.Logf("%-70s %s", what, time.Since(start).Round(10*time.Millisecond)) }()
	for !cond() {
		for _, p := range procs {
			if !p.running() {
				t.Fatalf("%s exited (%v) while waiting for %s", p.name, p.err, what)
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s within %s", what, within)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
