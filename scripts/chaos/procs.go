package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is one child process of the run (a NATS node, PouchDB Server, a product binary) that the
// run starts, kills, pauses and restarts. Its stdout and stderr are appended to one log file
// across restarts, each start marked by a line "=== chaos: start #n".
//
// Faults on one process are serialized by Lock/Unlock (the fault holds it for its whole
// duration). An exit the run did not cause is recorded — as a startup exit when the process
// had not been ready yet or started less than startupGrace ago, as a crash otherwise — and the
// process is started again a second later, as a supervisor would, so that the run goes on.
type proc struct {
	name    string
	path    string
	args    []string
	env     []string
	dir     string
	logPath string
	ready   string // URL answering 200 once the process is ready ("" = started is ready)
	run     *run
	links   *links // a product process's proxies to NATS and CouchDB (nil for the servers)

	sync.Mutex // held by a fault on this process

	mu           sync.Mutex
	cmd          *exec.Cmd
	done         chan struct{}
	exitErr      error
	expectExit   bool
	starts       int
	pids         []int // of every incarnation, in start order
	dumped       bool  // ended with SIGQUIT for its goroutine stacks (dumpStacks)
	startedAt    time.Time
	wasReady     bool     // the current incarnation answered its ready URL once
	crashes      []string // exits by itself once started (see startupGrace)
	startupExits []string // exits by itself while starting
}

// startupGrace is how long after its start an exit still counts as a startup exit even if the
// process answered its ready URL already: a consumer serves /readyz before its worker has
// looked up the JetStream consumer, which can still fail.
const startupGrace = 30 * time.Second

// start starts the process. It must not be running.
func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.startLocked()
}

func (p *proc) startLocked() error {
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	p.starts++
	fmt.Fprintf(logf, "=== chaos: start #%d at +%s\n", p.starts, p.run.since())
	cmd := exec.Command(p.path, p.args...)
	cmd.Env, cmd.Dir = p.env, p.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	// Killed with the run if the run itself dies (a test timeout); a Ctrl-C reaches it directly.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	p.run.track(cmd.Process.Pid)
	p.pids = append(p.pids, cmd.Process.Pid)
	done := make(chan struct{})
	p.cmd, p.done, p.expectExit, p.exitErr, p.wasReady, p.startedAt = cmd, done, false, nil, p.ready == "", time.Now()
	go p.watchReady(done)
	go func() {
		err := cmd.Wait()
		_ = logf.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		p.exitErr = err
		close(done)
		if p.expectExit {
			return
		}
		// Like a supervisor (systemd, Kubernetes), the run starts it again after a second.
		last := lastLine(p.logTail(3))
		if up := time.Since(p.startedAt); p.wasReady && up > startupGrace {
			p.crashes = append(p.crashes, fmt.Sprintf("+%s %s exited by itself %s after its start: %v; last log line: %s", p.run.since(), p.name, up.Round(time.Second), err, last))
			p.run.logf("CRASH: %s exited by itself (%v); starting it again", p.name, err)
		} else {
			p.startupExits = append(p.startupExits, fmt.Sprintf("+%s %s exited while starting (%s after its start, ready: %t): %v; last log line: %s",
				p.run.since(), p.name, time.Since(p.startedAt).Round(100*time.Millisecond), p.wasReady, err, last))
			p.run.logf("STARTUP EXIT: %s exited before it was ready (%v): %s; starting it again", p.name, err, last)
		}
		starts := p.starts
		go func() {
			time.Sleep(time.Second)
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.starts == starts && !p.expectExit {
				if err := p.startLocked(); err != nil {
					p.run.logf("restart of %s failed: %v", p.name, err)
				}
			}
		}()
	}()
	return nil
}

// watchReady notes when the incarnation that ends with done first answers its ready URL.
func (p *proc) watchReady(done chan struct{}) {
	if p.ready == "" {
		return
	}
	for {
		select {
		case <-done:
			return
		case <-time.After(200 * time.Millisecond):
		}
		if httpStatus(context.Background(), p.ready) == http.StatusOK {
			p.mu.Lock()
			if p.done == done {
				p.wasReady = true
			}
			p.mu.Unlock()
			return
		}
	}
}

// lastLine returns the last line of text, at most 300 bytes of it.
func lastLine(text string) string {
	lines := strings.Split(strings.TrimSpace(text), "\n")
	l := lines[len(lines)-1]
	return l[:min(len(l), 300)]
}

// wasDumped reports whether dumpStacks ended the process.
func (p *proc) wasDumped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dumped
}

// allPIDs returns the process ids of every incarnation so far.
func (p *proc) allPIDs() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int(nil), p.pids...)
}

// running reports whether the process has not exited.
func (p *proc) running() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// pid returns the current process id (0 when it never started).
func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// signal sends sig to the running process.
func (p *proc) signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return errors.New(p.name + " never started")
	}
	return p.cmd.Process.Signal(sig)
}

// stop sends sig (SIGKILL or SIGTERM) and waits for the exit; after grace it sends SIGKILL.
// It returns the exit error (nil for status 0) and whether SIGKILL was needed after a SIGTERM.
func (p *proc) stop(sig syscall.Signal, grace time.Duration) (exitErr error, forced bool) {
	p.mu.Lock()
	if p.cmd == nil || p.done == nil {
		p.mu.Unlock()
		return nil, false
	}
	p.expectExit = true
	done, process := p.done, p.cmd.Process
	p.mu.Unlock()
	select {
	case <-done:
	default:
		_ = process.Signal(syscall.SIGCONT) // a stopped process cannot handle SIGTERM
		_ = process.Signal(sig)
		select {
		case <-done:
		case <-time.After(grace):
			forced = true
			_ = process.Signal(syscall.SIGKILL)
			<-done
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitErr, forced
}

// restart stops the process with sig, waits down, and starts it again.
func (p *proc) restart(ctx context.Context, sig syscall.Signal, down time.Duration) error {
	p.stop(sig, 10*time.Second)
	if err := sleepCtx(ctx, down); err != nil {
		return err
	}
	return p.start()
}

// waitReady waits until the ready URL answers 200 (or, without one, until the process runs),
// at most within.
func (p *proc) waitReady(ctx context.Context, within time.Duration) error {
	return waitUntil(ctx, within, 100*time.Millisecond, p.name+" ready", func() bool {
		if !p.running() {
			return false
		}
		return p.ready == "" || httpStatus(ctx, p.ready) == http.StatusOK
	})
}

// exits returns the exits the run did not cause: after the process was ready (crashes) and
// before (startup exits).
func (p *proc) exits() (crashes, startupExits []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.crashes...), append([]string(nil), p.startupExits...)
}

// logTail returns the last n lines of the process's log file.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// httpStatus returns the status of GET url (0 when there is no answer within 2s).
func httpStatus(ctx context.Context, url string) int {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode
}

// waitUntil polls cond every step until it holds; it returns an error naming what when within
// passes or ctx ends first.
func waitUntil(ctx context.Context, within, step time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("no %s within %s", what, within)
		}
		if err := sleepCtx(ctx, step); err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
	}
	return nil
}

// sleepCtx waits d or until ctx ends. The run uses it for the plan's own timing and for the
// polling step of waitUntil, never as synchronization.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// alive reports whether a process with id pid exists (a zombie counts: the run reaps its
// children, so none should be left).
func alive(pid int) bool {
	return syscall.Kill(pid, 0) == nil
}
