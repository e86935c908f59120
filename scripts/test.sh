#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run): installs what the tests need, starts PouchDB
# Server unless COUCHDB_URL names a server, runs the whole suite with the race detector, and stops
# everything it started, also when tests fail.
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

if [ -z "${COUCHDB_URL:-}" ]; then
  start_pouchdb "$work/couchdb"
else
  log "using the CouchDB at COUCHDB_URL"
fi
export SPIEGEL_REQUIRE_COUCHDB=1

log "go vet"
go vet ./...
log "building binaries"
make -s build
log "go test -race"
go test -race -count=1 -timeout 40m ${TEST_FLAGS:-} ./...
