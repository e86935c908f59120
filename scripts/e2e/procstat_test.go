package e2e

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/spiegel-nats/spiegel/scripts/e2e/benchdata"
)

// clockTicks is USER_HZ, the unit of utime and stime in /proc/<pid>/stat: 100 on every Linux
// this runs on (the kernel fixes it for userspace whatever CONFIG_HZ is).
const clockTicks = 100

// readProc reads a process's resident memory and CPU time from /proc/<pid>/status and
// /proc/<pid>/stat, and counts its established TCP connections to 127.0.0.1:couchPort (its
// counting proxy) from /proc/<pid>/fd and /proc/<pid>/net/tcp.
func readProc(pid, couchPort int) (benchdata.Proc, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid))
	var p benchdata.Proc
	status, err := os.ReadFile(filepath.Join(dir, "status"))
	if err != nil {
		return p, fmt.Errorf("read status of %d: %w", pid, err)
	}
	stat, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return p, fmt.Errorf("read stat of %d: %w", pid, err)
	}
	p.RSSBytes = vmRSS(string(status))
	ticks, err := cpuTicks(string(stat))
	if err != nil {
		return p, fmt.Errorf("parse stat of %d: %w", pid, err)
	}
	p.CPUSeconds = float64(ticks) / clockTicks
	entries, err := os.ReadDir(filepath.Join(dir, "fd"))
	if err != nil {
		return p, fmt.Errorf("list fds of %d: %w", pid, err)
	}
	var targets []string
	for _, e := range entries {
		if t, err := os.Readlink(filepath.Join(dir, "fd", e.Name())); err == nil {
			targets = append(targets, t)
		}
	}
	inodes := socketInodes(targets)
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(filepath.Join(dir, "net", table))
		if err != nil {
			continue // no IPv6
		}
		p.CouchConns += establishedTo(string(b), inodes, couchPort)
	}
	return p, nil
}

// vmRSS returns the VmRSS line of /proc/<pid>/status in bytes (0 when absent, as for a zombie).
func vmRSS(status string) int64 {
	for line := range strings.Lines(status) {
		rest, ok := strings.CutPrefix(line, "VmRSS:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 2 && f[1] == "kB" {
			if kb, err := strconv.ParseInt(f[0], 10, 64); err == nil {
				return kb * 1024
			}
		}
	}
	return 0
}

// cpuTicks returns utime + stime of /proc/<pid>/stat. The command name (field 2) is in
// parentheses and may itself hold spaces and parentheses, so fields count from the last ')'.
func cpuTicks(stat string) (uint64, error) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("no ')' in %q", stat)
	}
	f := strings.Fields(stat[i+1:]) // f[0] is field 3 (state): utime is field 14, stime 15
	if len(f) < 13 {
		return 0, fmt.Errorf("%d fields after the command name, want at least 13", len(f))
	}
	utime, err := strconv.ParseUint(f[11], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("utime: %w", err)
	}
	stime, err := strconv.ParseUint(f[12], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("stime: %w", err)
	}
	return utime + stime, nil
}

// socketInodes returns the inodes of the "socket:[N]" targets of /proc/<pid>/fd links.
func socketInodes(targets []string) map[string]bool {
	out := map[string]bool{}
	for _, t := range targets {
		if n, ok := strings.CutPrefix(t, "socket:["); ok && strings.HasSuffix(n, "]") {
			out[strings.TrimSuffix(n, "]")] = true
		}
	}
	return out
}

// establishedTo counts the rows of a /proc/net/tcp{,6} table that are ESTABLISHED (st 01), have
// remote port port and belong to one of inodes.
func establishedTo(table string, inodes map[string]bool, port int) int {
	want := fmt.Sprintf(":%04X", port)
	n := 0
	sc := bufio.NewScanner(strings.NewReader(table))
	for sc.Scan() {
		// sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
		f := strings.Fields(sc.Text())
		if len(f) < 10 || f[0] == "sl" {
			continue
		}
		if f[3] == "01" && strings.HasSuffix(f[2], want) && inodes[f[9]] {
			n++
		}
	}
	return n
}

func TestProcParsers(t *testing.T) {
	t.Parallel()
	t.Run("vmRSS", func(t *testing.T) {
		t.Parallel()
		assert.Equal(t, int64(12345*1024), vmRSS("Name:\tproducer\nVmPeak:\t  99 kB\nVmRSS:\t   12345 kB\nThreads:\t8\n"))
		assert.Zero(t, vmRSS("Name:\tzombie\nState:\tZ (zombie)\n"))
	})
	t.Run("cpuTicks", func(t *testing.T) {
		t.Parallel()
		// A command name with spaces and a ')' must not shift the fields.
		stat := "4242 (we) ird x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 8 0 12345 0 0"
		got, err := cpuTicks(stat)
		assert.NoError(t, err)
		assert.Equal(t, uint64(325), got)
		_, err = cpuTicks("4242 (short) S 1 2")
		assert.Error(t, err)
	})
	t.Run("connections", func(t *testing.T) {
		t.Parallel()
		inodes := socketInodes([]string{"socket:[111]", "socket:[222]", "pipe:[333]", "/dev/null", "socket:[444]"})
		assert.Equal(t, map[string]bool{"111": true, "222": true, "444": true}, inodes)
		// 127.0.0.1:50000 → 127.0.0.1:8080 (0x1F90), established, ours; one of another process;
		// one in TIME_WAIT (06); one to another port; the listener (0A).
		table := `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 111 1 0 20 4 30 10 -1
   1: 0100007F:C351 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 999 1 0 20 4 30 10 -1
   2: 0100007F:C352 0100007F:1F90 06 00000000:00000000 03:00000A3B 00000000     0        0 222 3 0 20 4 30 10 -1
   3: 0100007F:C353 0100007F:1F91 01 00000000:00000000 00:00000000 00000000     0        0 444 1 0 20 4 30 10 -1
   4: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0 20 4 30 10 -1
`
		assert.Equal(t, 1, establishedTo(table, inodes, 8080))
		assert.Equal(t, 1, establishedTo(table, inodes, 8081))
		assert.Zero(t, establishedTo(table, inodes, 5984))
	})
	t.Run("this process", func(t *testing.T) {
		t.Parallel()
		p, err := readProc(os.Getpid(), 1)
		assert.NoError(t, err)
		assert.Positive(t, p.RSSBytes)
	})
}
