package chaos

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// journal is one of the run's own log files in the output dir (writer.log, sink.log, changes.log,
// order.log), one line per event, stamped with the run's clock.
type journal struct {
	mu sync.Mutex
	f  *os.File
	r  *run
}

// newJournal creates <OutDir>/<name>.log; on error the journal writes nothing.
func (r *run) newJournal(name string) *journal {
	f, _ := os.Create(filepath.Join(r.cfg.OutDir, name+".log"))
	j := &journal{f: f, r: r}
	r.mu.Lock()
	r.journals = append(r.journals, j)
	r.mu.Unlock()
	return j
}

// printf writes one line stamped with the run's clock.
func (j *journal) printf(format string, args ...any) {
	if j == nil || j.f == nil {
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	fmt.Fprintf(j.f, "+%8.3f %s\n", time.Since(j.r.started).Seconds(), fmt.Sprintf(format, args...))
}

func (j *journal) close() {
	if j != nil && j.f != nil {
		_ = j.f.Close()
	}
}

// dumpChanges writes the change stream as read, in stream order, to changes.log.
func (r *run) dumpChanges() {
	if r.changes == nil {
		return
	}
	j := r.newJournal("changes")
	for _, m := range r.changes.all() {
		j.printf("#%d %s %s %s feed=%s id=%s", m.Seq, m.DB, m.ID, m.Rev, m.Feed, m.MsgID)
	}
}
