#!/usr/bin/env bash
# The bench command (`make bench`): builds the binaries, runs every benchmark against the same
# kind of servers the tests use and writes bench-report.md, with the workload benchmark's tables
# (scripts/e2e, BenchmarkWorkload). Figures are reported next to a baseline measured in the same
# run (ratios), because this machine's absolute speed varies.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
work=$(mktemp -d "${TMPDIR:-/tmp}/spiegel-bench.XXXXXX")
trap 'stop_started; rm -rf "$work"' EXIT
go mod download
if [ -z "${COUCHDB_URL:-}" ]; then
  start_pouchdb "$work/couchdb"
  export BENCH_SERVER_PID=$POUCHDB_PID # the server's CPU per change (BenchmarkDispatch)
fi
report="$ROOT/bench-report.md"
raw="$work/bench.txt"
log "building binaries (the workload benchmark runs them)"
make --no-print-directory build >/dev/null
log "running benchmarks (BENCHTIME=${BENCHTIME:-1x})"
# The scale simulation at one small N here; `make bench-scale` runs it at 10k, 30k and 100k dbs.
export SPIEGEL_SCALE_DBS=${SPIEGEL_SCALE_DBS:-1000}
BENCH_REPORT_DIR="$work" go test -run '^$' -bench "${BENCH:-.}" -benchtime "${BENCHTIME:-1x}" -timeout 60m ./... | tee "$raw"
{
  echo "# Benchmark report"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(go version | cut -d' ' -f3-)"
  echo "- CouchDB: $(printf '%s' "$COUCHDB_URL" | sed -E 's#//[^@/]*@#//#')$( [ -n "${POUCHDB_PID:-}" ] && echo ' (PouchDB Server, in memory)')"
  echo
  echo '```'
  grep -E '^(Benchmark|pkg:|ok|PASS|FAIL)' "$raw"
  echo '```'
  if [ -f "$work/workload.md" ]; then
    echo
    cat "$work/workload.md"
  fi
} > "$report"
log "wrote $report"
