#!/usr/bin/env bash
# The end-to-end bench command (`make bench-e2e`): builds the binaries, starts PouchDB Server
# (or uses COUCHDB_URL), runs the workload benchmark (scripts/e2e, BenchmarkWorkload) once per
# number of dbs in BENCH_NS with our pipeline and the server's own _replicator as the baseline,
# and writes bench-e2e/report.md with its charts (scripts/benchreport, a Go module of its own so
# that its plotting library stays out of the product's go.mod). Figures are compared as
# ratios against the baseline measured in the same run; nothing here asserts a timing.
#
# With `scaling` among BENCH_SETUPS it also runs, per N, the horizontal scaling benchmark
# (BenchmarkScaling: 1, 2, 4 replicator and then onchange processes draining a backlog of N jobs).
#
# Variables: BENCH_NS (100,1000), BENCH_SETUPS (hot,replicator, run in that order; add scaling), BENCH_OUT
# (bench-e2e), and those of the benchmarks: BENCH_RATE, BENCH_DURATION, BENCH_IDLE,
# BENCH_SYNC_LIMIT, BENCH_SCALING_PROCS, BENCH_SCALING_GROUPS, BENCH_SCALING_CONCURRENCY,
# BENCH_SERVER_PID (set here when PouchDB Server is started here), BENCH_Q, BENCH_TIMEOUT (go test's,
# 120m per N).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
out=${BENCH_OUT:-$ROOT/bench-e2e}
ns=${BENCH_NS:-100,1000}
setups=${BENCH_SETUPS:-hot,replicator}
scaling=0 # the scaling benchmark is a setup of its own; the others are the workload's
workload_setups=()
for s in ${setups//,/ }; do
  if [ "$s" = scaling ]; then scaling=1; else workload_setups+=("$s"); fi
done
setups=$(IFS=,; echo "${workload_setups[*]}")
work=$(mktemp -d "${TMPDIR:-/tmp}/spiegel-bench-e2e.XXXXXX")
trap 'stop_started; rm -rf "$work"' EXIT
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
go mod download
(cd scripts/benchreport && go mod download)
if [ -z "${COUCHDB_URL:-}" ]; then
  start_pouchdb "$work/couchdb"
  export BENCH_SERVER_PID=$POUCHDB_PID
fi
log "building binaries (the workload benchmark runs them)"
make --no-print-directory build >/dev/null
rm -rf "$out"
mkdir -p "$out/runs"
out=$(cd "$out" && pwd) # the report generator runs in its own module's directory
failed=()
for n in ${ns//,/ }; do
  if [ "$scaling" = 1 ]; then
    log "horizontal scaling at N=$n; output in $out/runs/scaling-$n.txt"
    if ! BENCH_DBS=$n BENCH_REPORT_DIR="$out/runs" \
      go test -run '^$' -bench BenchmarkScaling -benchtime 1x -timeout "${BENCH_TIMEOUT:-120m}" ./scripts/e2e \
      >"$out/runs/scaling-$n.txt" 2>&1; then
      log "the scaling benchmark at N=$n failed; its output (tail):"
      tail -20 "$out/runs/scaling-$n.txt" >&2
      failed+=("$n (scaling)")
    fi
    grep -E '^\s+scaling_test.go' "$out/runs/scaling-$n.txt" >&2 || true
  fi
  [ -n "$setups" ] || continue
  log "workload at N=$n ($setups); output in $out/runs/bench-$n.txt"
  if ! BENCH_DBS=$n BENCH_SETUPS=$setups BENCH_REPORT_DIR="$out/runs" \
    go test -run '^$' -bench BenchmarkWorkload -benchtime 1x -timeout "${BENCH_TIMEOUT:-120m}" ./scripts/e2e \
    >"$out/runs/bench-$n.txt" 2>&1; then
    log "the workload at N=$n failed; its output (tail):"
    tail -20 "$out/runs/bench-$n.txt" >&2
    failed+=("$n")
  fi
  grep -E '^\s+workload_test.go' "$out/runs/bench-$n.txt" >&2 || true
  if [ -f "$out/runs/workload.md" ]; then mv "$out/runs/workload.md" "$out/runs/workload-$n.md"; fi
done
(cd scripts/benchreport && go run . -in "$out/runs" -out "$out" -load-start "$load_start")
if [ ${#failed[@]} -gt 0 ]; then
  log "no figures for N=${failed[*]}: the report holds the others"
  exit 1
fi
log "wrote $out/report.md"
