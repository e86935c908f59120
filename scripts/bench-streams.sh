#!/usr/bin/env bash
# The change-streams bench command (`make bench-streams`): builds the binaries, starts PouchDB
# Server (or uses COUCHDB_URL), and runs BenchmarkStreams (scripts/e2e) once: per workload and
# NATS topology, a hand-written _changes → PublishMsgAsync loop (the baseline, run before and
# after the rules), a `subject` rule and a `mirror` rule through bin/producer and one
# bin/onchange. It writes bench-streams/report.md (docs/s per variant, the ratios rule ÷ loop, the
# machine's load, CouchDB's and nats-server's versions), the go test output (bench.txt) and the
# pipeline's process logs (logs/). Nothing here asserts a timing; a variant that does not finish
# within BENCH_STREAMS_LIMIT fails the run, saying how far it got.
#
# Variables: BENCH_STREAMS_WORKLOADS (1x100000,1x20000,100x500: dbs x docs per db),
# BENCH_STREAMS_TOPOLOGIES (r1,r3), BENCH_STREAMS_LIMIT (10m per variant), BENCH_STREAMS_VARS
# (extra SPIEGEL_ variables of the pipeline's processes, space-separated), BENCH_STREAMS_DROP_DBS
# (1: delete the workload dbs at the end; they are kept and reused by default), BENCH_SERVER_PID
# (the CouchDB server's process, for its CPU time; set here when PouchDB Server is started here),
# BENCH_OUT (bench-streams), BENCH_TIMEOUT (go test's, 180m).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
out=${BENCH_OUT:-$ROOT/bench-streams}
work=$(mktemp -d "${TMPDIR:-/tmp}/spiegel-bench-streams.XXXXXX")
trap 'stop_started; rm -rf "$work"' EXIT
go mod download
if [ -z "${COUCHDB_URL:-}" ]; then
  start_pouchdb "$work/couchdb"
  export BENCH_SERVER_PID=$POUCHDB_PID
fi
log "building binaries (the benchmark runs them)"
make --no-print-directory build >/dev/null
rm -rf "$out"
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
log "change streams: workloads ${BENCH_STREAMS_WORKLOADS:-1x100000,1x20000,100x500}, topologies ${BENCH_STREAMS_TOPOLOGIES:-r1,r3}; output in $out/bench.txt"
status=0
BENCH_OUT=$out BENCH_PROC_LOG_DIR=$out/logs BENCH_STREAMS_COMMIT=$(git describe --always --dirty 2>/dev/null || echo unknown) \
  go test -v -run '^$' -bench '^BenchmarkStreams$' -benchtime 1x -timeout "${BENCH_TIMEOUT:-180m}" ./scripts/e2e \
  >"$out/bench.txt" 2>&1 || status=$?
grep -E '^\s+streams_[a-z]+_test\.go|^Benchmark|^(--- )?FAIL|^ok|^PASS' "$out/bench.txt" >&2 || true
if [ "$status" != 0 ]; then
  log "the benchmark failed (exit $status); its output: $out/bench.txt (tail):"
  tail -30 "$out/bench.txt" >&2
fi
if [ -f "$out/report.md" ]; then
  log "wrote $out/report.md"
fi
exit "$status"
