#!/usr/bin/env bash
# The run command (README, `make run`): starts what is missing — NATS from this module's pinned
# nats-server unless SPIEGEL_NATS_URL is set, PouchDB Server unless COUCHDB_URL is set — installs,
# starts a producer, a replicator and an onchange consumer, and runs the demo. Ctrl-C (or the end
# of SPIEGEL_DEMO_DURATION, for a headless run) stops everything it started.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

state="$ROOT/.run"
rm -rf "$state"
mkdir -p "$state"
cleanup() {
  local rc=$?
  log "stopping everything this command started"
  stop_started
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ -x bin/producer ] && [ -x bin/replicator ] && [ -x bin/onchange ] && [ -x bin/nats-server ] || make -s build

if [ -z "${SPIEGEL_NATS_URL:-}" ]; then
  port=$(free_port)
  bin/nats-server -js -a 127.0.0.1 -p "$port" -sd "$state/nats" >"$state/nats.log" 2>&1 &
  STARTED_PIDS+=("$!")
  export SPIEGEL_NATS_URL="nats://127.0.0.1:$port"
  for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
  log "NATS $(bin/nats-server --version 2>/dev/null | head -1) on $SPIEGEL_NATS_URL (pid ${STARTED_PIDS[-1]})"
fi
if [ -z "${COUCHDB_URL:-}" ]; then
  start_pouchdb "$state/couchdb"
fi
export SPIEGEL_COUCHDB_URL="${SPIEGEL_COUCHDB_URL:-$COUCHDB_URL}"
export SPIEGEL_LOG_FORMAT="${SPIEGEL_LOG_FORMAT:-text}"
export SPIEGEL_POLL_INTERVAL="${SPIEGEL_POLL_INTERVAL:-500ms}"

log "producer install"
bin/producer install

start_bg() {
  local name=$1 addr=$2
  shift 2
  SPIEGEL_HTTP_ADDR="$addr" "$@" >"$state/$name.log" 2>&1 &
  STARTED_PIDS+=("$!")
  log "$name started (pid $!, logs in .run/$name.log, metrics on http://$addr/metrics)"
}
start_bg producer "${SPIEGEL_RUN_PRODUCER_ADDR:-127.0.0.1:8080}" bin/producer
start_bg replicator "${SPIEGEL_RUN_REPLICATOR_ADDR:-127.0.0.1:8081}" bin/replicator
# The demo's webhook listens on 127.0.0.1, which onchange refuses unless the allow-list names it.
SPIEGEL_WEBHOOK_ALLOWED_HOSTS="127.0.0.1${SPIEGEL_WEBHOOK_ALLOWED_HOSTS:+,$SPIEGEL_WEBHOOK_ALLOWED_HOSTS}" \
  start_bg onchange "${SPIEGEL_RUN_ONCHANGE_ADDR:-127.0.0.1:8082}" bin/onchange

demo_args=()
[ -n "${SPIEGEL_DEMO_DURATION:-}" ] && demo_args+=(-duration "$SPIEGEL_DEMO_DURATION")
[ -n "${SPIEGEL_DEMO_INTERVAL:-}" ] && demo_args+=(-interval "$SPIEGEL_DEMO_INTERVAL")
if [ -n "${SPIEGEL_DEMO_DURATION:-}" ]; then
  log "demo running for $SPIEGEL_DEMO_DURATION"
else
  log "demo running until Ctrl-C"
fi
go run ./scripts/demo "${demo_args[@]}"
