#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run): installs what the tests need, starts PouchDB
# Server unless COUCHDB_URL names a server, runs the whole suite with the race detector — the main
# module's (the short chaos run of scripts/chaos included), the deployments module's
# (deployments/, the deployment-validation tests) and the bench report's (scripts/benchreport) —
# and stops everything it started, also when tests fail.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

work=$(mktemp -d "${TMPDIR:-/tmp}/spiegel-test.XXXXXX")
cleanup() {
  local rc=$?
  stop_started
  if [ -f "$work/couchdb/server.log" ]; then
    local n
    n=$(grep -c UnhandledPromiseRejection "$work/couchdb/server.log" || true)
    log "PouchDB Server logged ${n:-0} UnhandledPromiseRejection line(s)"
  fi
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "downloading Go modules"
go mod download
(cd deployments && go mod download)
(cd scripts/benchreport && go mod download)

if [ -z "${COUCHDB_URL:-}" ]; then
  start_pouchdb "$work/couchdb"
  # The chaos run (scripts/chaos, TestChaosShort) starts its own PouchDB Server on disk, which it
  # restarts as one of its faults.
else
  log "using the CouchDB at COUCHDB_URL (the chaos run too: it never restarts that one; its restart fault is an outage at a proxy)"
  export CHAOS_COUCHDB_URL=${CHAOS_COUCHDB_URL:-$COUCHDB_URL}
fi
export SPIEGEL_REQUIRE_COUCHDB=1

log "go vet"
go vet ./...
log "deployments (its own module): go vet and go test -race"
(cd deployments && go vet ./... && go test -race -count=1 -timeout 10m ${TEST_FLAGS:-} ./...)
log "scripts/benchreport (its own module): go vet and go test -race"
(cd scripts/benchreport && go vet ./... && go test -race -count=1 -timeout 10m ${TEST_FLAGS:-} ./...)
log "building binaries"
make -s build
log "go test -race"
go test -race -count=1 -timeout 40m ${TEST_FLAGS:-} ./...
