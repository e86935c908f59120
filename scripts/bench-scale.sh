#!/usr/bin/env bash
# The scale simulation (`make bench-scale`): runs BenchmarkScale (pkg/producer) — the producer
# engine, JetStream and the consumer job path over a fake CouchDB of N dbs, no real CouchDB —
# for each N in SCALE_DBS, with the NATS server as a process of its own (bin/nats-server) so
# that the heap figures are the product's alone, then draws one chart per figure against N and a
# table (scripts/benchreport -scale-in) into bench-scale/scale.md. Nothing here asserts a timing.
#
# Variables: SCALE_DBS (10000,30000,100000), SCALE_CONSUMERS (1), SCALE_OUT (bench-scale),
# SCALE_TIMEOUT (go test's, 60m). It runs under `nice -n 19` with -p 1: the machine is shared.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
out=${SCALE_OUT:-$ROOT/bench-scale}
mkdir -p "$out" bin
out=$(cd "$out" && pwd) # the report generator runs in its own module's directory
log "building the NATS server"
nice -n 19 go build -o bin/nats-server github.com/nats-io/nats-server/v2
log "scale simulation at N=${SCALE_DBS:-10000,30000,100000}; output in $out/bench.txt"
SPIEGEL_SCALE_DBS=${SCALE_DBS:-10000,30000,100000} SPIEGEL_SCALE_CONSUMERS=${SCALE_CONSUMERS:-1} \
  SPIEGEL_SCALE_REPORT="$out/scale.json" SPIEGEL_SCALE_NATS_SERVER="$ROOT/bin/nats-server" \
  nice -n 19 go test -p 1 -run '^$' -bench '^BenchmarkScale$' -benchtime 1x -timeout "${SCALE_TIMEOUT:-60m}" ./pkg/producer \
  | tee "$out/bench.txt"
(cd scripts/benchreport && nice -n 19 go run . -scale-in "$out/scale.json" -out "$out")
log "wrote $out/scale.md"
