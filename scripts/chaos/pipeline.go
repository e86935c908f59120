package chaos

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/freeport"
)

// Names of the run's rules (docs in the spiegel db).
const (
	ruleReplicate = "chaos_replicate"
	ruleHook      = "chaos_hook"
	ruleSlow      = "chaos_slow" // block: true, on the first slowDBs source dbs, answered after slowFor
	rulePublish   = "chaos_publish"
	ruleMirror    = "chaos_mirror"

	// mirrorBucket is the KV bucket of ruleMirror's doc-state mirror.
	mirrorBucket  = "CHAOS_MIRROR"
	hookTimeout   = 2 * time.Second // timeout_ms of the webhook rules
	hotFeedsSmall = 4               // SPIEGEL_HOT_FEEDS of producer-2
	hotFeedIdle   = 5 * time.Second // SPIEGEL_HOT_FEED_IDLE of both producers
)

// ruleSlow's dbs and answers.
const (
	// slowFor is how long the sink takes to answer each request of ruleSlow: less than
	// hookTimeout, and less than the part of AckWait a lease has left when its holder is
	// SIGSTOPped (the overlap verdict, overlap.go), yet with a db's backlog of changes sent one
	// at a time (block: true) its jobs last several AckWaits.
	slowFor = 500 * time.Millisecond
	slowDBs = 3 // source dbs 0, 1, 2 have ruleSlow
)

// Names of the run's dbs; prefix is unique to the run ("chaos_<random>_"), so that a shared
// CouchDB never sees the run touch a db it did not create.
func (r *run) spiegelDB() string     { return r.prefix + "spiegel" }
func (r *run) sourceDB(i int) string { return fmt.Sprintf("%ssrc_%03d", r.prefix, i) }

// slowDB reports whether source db src has ruleSlow.
func (r *run) slowDB(src string) bool {
	for i := range min(slowDBs, r.cfg.DBs) {
		if src == r.sourceDB(i) {
			return true
		}
	}
	return false
}

// slowPattern is ruleSlow's db_name: the first slowDBs source dbs.
func (r *run) slowPattern() string {
	var names []string
	for i := range min(slowDBs, r.cfg.DBs) {
		names = append(names, regexp.QuoteMeta(r.sourceDB(i)))
	}
	return "^(" + strings.Join(names, "|") + ")$"
}

// targetDB is the target of source db src under the replicator rule.
func (r *run) targetDB(src string) string { return r.prefix + "tgt_" + src }

// commonEnv is the environment of every product process: no SPIEGEL_ variable of the run's
// own environment leaks in.
func (r *run) commonEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SPIEGEL_") {
			env = append(env, kv)
		}
	}
	return append(env,
		"SPIEGEL_COUCHDB_URL="+r.couch.procURL,
		"SPIEGEL_DB_NAME="+r.spiegelDB(),
		"SPIEGEL_NATS_URL="+r.nats.URLs(),
		"SPIEGEL_STREAM_REPLICAS=3",
		"SPIEGEL_ACK_WAIT="+r.cfg.AckWait.String(),
		"SPIEGEL_LOG_LEVEL="+r.cfg.LogLevel,
		"SPIEGEL_SHUTDOWN_GRACE=5s",
		// A request caught by a CouchDB restart may hang on a connection nobody answers until
		// its timeout: 10s instead of the default 30s keeps the run within its quiesce limit.
		"SPIEGEL_COUCHDB_TIMEOUT=10s",
	)
}

// install runs `producer install` (streams with 3 replicas) — again, 2 s later, while it fails
// for up to 90 s, as an operator would with a freshly formed cluster: install is idempotent —
// and writes the rules.
func (r *run) install(ctx context.Context) error {
	logPath := filepath.Join(r.logDir, "producer-install.log")
	var err error
	// A cluster that formed moments ago may answer at once that a peer is offline ("no suitable
	// peers for placement"): the attempts are paced, 2 s apart, 90 s in all at most.
	deadline := time.Now().Add(90 * time.Second)
	for attempt := 1; ; attempt++ {
		if attempt > 1 {
			if time.Now().After(deadline) {
				break
			}
			if serr := sleepCtx(ctx, 2*time.Second); serr != nil {
				break
			}
		}
		cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		// --timeout: a freshly formed cluster may take a while to elect its meta leader.
		cmd := exec.CommandContext(cctx, filepath.Join(r.cfg.Root, "bin", "producer"), "install", "--timeout", "45s")
		cmd.Env = r.commonEnv()
		var out []byte
		out, err = cmd.CombinedOutput()
		cancel()
		if f, ferr := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); ferr == nil {
			fmt.Fprintf(f, "=== chaos: producer install, attempt %d: %v\n%s", attempt, err, out)
			_ = f.Close()
		}
		if err == nil {
			break
		}
		r.logf("producer install failed (attempt %d, output in %s): %v", attempt, logPath, err)
	}
	if err != nil {
		return fmt.Errorf("producer install: %v (output in %s)", err, logPath)
	}
	pattern := "^" + r.prefix + "src_"
	retry := map[string]any{"backoff": "exponential", "delay_ms": 200, "multiplier": 2, "max_delay_ms": 2000, "limit": 0}
	rules := map[string]map[string]any{
		ruleReplicate: {"type": "replicator", "db_name": pattern, "source": "$db_name",
			"target": r.prefix + "tgt_${db_name}", "create_target": true},
		ruleHook: {"type": "on_change", "db_name": pattern, "method": "POST",
			"url":        "http://" + hookUser + "@" + r.sink.addr() + "/" + hookPath + "/${db_name}",
			"params":     map[string]any{"change": "$change", "db": "$db_name", "seq": "$seq"},
			"timeout_ms": hookTimeout.Milliseconds(), "retry": retry},
		// Long jobs: each change waits for its answer, which takes slowFor, so that jobs run
		// through consumer leader changes (the overlap verdict's case).
		ruleSlow: {"type": "on_change", "db_name": r.slowPattern(), "method": "POST", "block": true,
			"url":        "http://" + hookUser + "@" + r.sink.addr() + "/" + slowPath + "/${db_name}",
			"params":     map[string]any{"change": "$change", "db": "$db_name", "seq": "$seq"},
			"timeout_ms": hookTimeout.Milliseconds(), "retry": retry},
		rulePublish: {"type": "on_change", "db_name": pattern, "subject": "spiegel.changes.${db_name}", "retry": retry},
		ruleMirror:  {"type": "on_change", "db_name": pattern, "mirror": mirrorBucket, "retry": retry},
	}
	for id, doc := range rules {
		status, err := r.couch.do(ctx, http.MethodPut, "/"+r.spiegelDB()+"/"+id, doc, nil)
		if err != nil || status != http.StatusCreated && status != http.StatusAccepted {
			return fmt.Errorf("put rule %s: status %d, %v", id, status, err)
		}
	}
	return nil
}

// sweepInterval is the producers' SPIEGEL_SWEEP_INTERVAL.
const sweepInterval = 30 * time.Second

// metricsURLs returns the /metrics URL of every product process.
func (r *run) metricsURLs() []string {
	out := make([]string, 0, len(r.procs))
	for _, p := range r.procs {
		out = append(out, strings.TrimSuffix(p.ready, "/readyz")+"/metrics")
	}
	return out
}

// startPipeline starts the six product processes (procNames), with partitions each reaching
// NATS and CouchDB through its own links (links.go), and waits until each is ready.
func (r *run) startPipeline(ctx context.Context) error {
	// With partitions (CHAOS_PARTITIONS=1) each process has its own proxies to NATS and CouchDB,
	// which the partition faults freeze or cut; without them it connects directly. They listen
	// before the processes' ports are chosen: a proxy listening later could take one (a run
	// failed so, its process unable to bind its port).
	procLinks := make([]*links, len(procNames))
	if r.cfg.Partitions {
		for i := range procNames {
			l, err := startLinks(r.nats, r.couch.procURL)
			if err != nil {
				for _, l := range procLinks[:i] {
					l.close()
				}
				return err
			}
			procLinks[i] = l
		}
	}
	ports, err := freeport.Ports(len(procNames))
	if err != nil {
		return err
	}
	common := r.commonEnv()
	consumer := []string{"SPIEGEL_PASSWORDS_FILE=" + r.sink.pwFile, "SPIEGEL_RETRY_INITIAL=200ms", "SPIEGEL_RETRY_MAX=3s",
		"SPIEGEL_WEBHOOK_ALLOWED_HOSTS=127.0.0.1"} // the sink listens on loopback, refused by default
	for i, name := range procNames {
		addr := fmt.Sprintf("127.0.0.1:%d", ports[i])
		env := append(append([]string(nil), common...), "SPIEGEL_HTTP_ADDR="+addr)
		bin := ""
		switch {
		case strings.HasPrefix(name, "producer"):
			bin = "producer"
			env = append(env, "SPIEGEL_POLL_INTERVAL=1s", "SPIEGEL_SWEEP_INTERVAL="+sweepInterval.String(), "SPIEGEL_FEED_HEARTBEAT=5s")
			// Hot feeds: producer-1 may keep one for every busy db, producer-2 only
			// hotFeedsSmall, so that it keeps refusing busy dbs at its limit; both close a feed
			// idle for hotFeedIdle, so that feeds close and reopen during the run.
			hot := "500"
			if name == "producer-2" {
				hot = fmt.Sprint(hotFeedsSmall)
			}
			env = append(env, "SPIEGEL_HOT_FEEDS="+hot, "SPIEGEL_HOT_FEED_IDLE="+hotFeedIdle.String())
		case strings.HasPrefix(name, "replicator"):
			bin = "replicator"
			env = append(append(env, consumer...), "SPIEGEL_REPLICATION_ENGINE="+strings.TrimPrefix(name, "replicator-"))
		default:
			bin = "onchange"
			env = append(env, consumer...)
		}
		l := procLinks[i]
		if l != nil {
			lenv, err := l.env(r.couch.procURL)
			if err != nil {
				return err
			}
			env = append(env, lenv...) // the last value of a variable wins
		}
		p := &proc{name: name, path: filepath.Join(r.cfg.Root, "bin", bin), env: env, dir: r.cfg.OutDir,
			logPath: filepath.Join(r.logDir, name+".log"), ready: "http://" + addr + "/readyz", run: r, links: l}
		if err := p.start(); err != nil {
			return err
		}
		r.procs = append(r.procs, p)
	}
	for _, p := range r.procs {
		if err := p.waitReady(ctx, 60*time.Second); err != nil {
			return fmt.Errorf("%w; its log ends:\n%s", err, p.logTail(15))
		}
	}
	return nil
}

// consumers are the processes that read the passwords file.
func (r *run) consumers() []*proc { return r.procs[2:] }
