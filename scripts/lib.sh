# Shared shell functions of the run and test commands. Source it; do not run it.
# Everything started here is recorded by PID and stopped by stop_started, even when a step fails.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STARTED_PIDS=()

log() { printf '\033[1m[spiegel]\033[0m %s\n' "$*" >&2; }

# free_port prints a free loopback TCP port that is not 5984.
free_port() {
  local port
  while :; do
    port=$(node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')
    [ "$port" != 5984 ] && { echo "$port"; return; }
  done
}

# wait_http URL SECONDS waits until URL answers 200.
wait_http() {
  local url=$1 secs=$2 i
  for ((i = 0; i < secs * 10; i++)); do
    if node -e 'require("http").get(process.argv[1],r=>process.exit(r.statusCode===200?0:1)).on("error",()=>process.exit(1))' "$url" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

# install_pouchdb installs the pinned PouchDB Server into scripts/pouchdb/node_modules with npm ci
# from scripts/pouchdb/package-lock.json (node_modules is not in git) whenever the installed tree
# was not installed from the lock as it is now. A successful install leaves the lock's sha256 in
# node_modules/.spiegel-lock.sha256; npm ci deletes node_modules first, so a failed or interrupted
# install leaves no stamp and the next call installs again.
install_pouchdb() {
  local dir="$ROOT/scripts/pouchdb" stamp want have=""
  stamp="$dir/node_modules/.spiegel-lock.sha256"
  want=$(sha256sum <"$dir/package-lock.json") || return 1
  want=${want%% *}
  [ -f "$stamp" ] && have=$(<"$stamp")
  if [ "$have" = "$want" ] && [ -f "$dir/node_modules/pouchdb-server/bin/pouchdb-server" ]; then
    return 0
  fi
  log "installing PouchDB Server (npm ci, pinned by scripts/pouchdb/package-lock.json)"
  if ! (cd "$dir" && npm ci --omit=optional --no-audit --no-fund --loglevel=error >&2); then
    log "npm ci in scripts/pouchdb failed"
    return 1
  fi
  printf '%s\n' "$want" >"$stamp"
}

# start_pouchdb DIR starts an in-memory PouchDB Server on a free loopback port with DIR as its
# working directory (it writes config.json and log.txt there) and sets COUCHDB_URL and
# POUCHDB_PID.
start_pouchdb() {
  local dir=$1 port
  install_pouchdb || return 1
  mkdir -p "$dir"
  port=$(free_port)
  (cd "$dir" && exec node --unhandled-rejections=warn "$ROOT/scripts/pouchdb/node_modules/pouchdb-server/bin/pouchdb-server" \
    -m -o 127.0.0.1 -p "$port" -n >"$dir/server.log" 2>&1) &
  POUCHDB_PID=$!
  STARTED_PIDS+=("$POUCHDB_PID")
  if ! wait_http "http://127.0.0.1:$port/" 30; then
    log "PouchDB Server did not answer on port $port within 30s; its log:"
    tail -20 "$dir/server.log" >&2 || true
    return 1
  fi
  COUCHDB_URL="http://127.0.0.1:$port"
  export COUCHDB_URL
  log "PouchDB Server $(node -p 'require(process.argv[1]).version' "$ROOT/scripts/pouchdb/node_modules/pouchdb-server/package.json") on $COUCHDB_URL (pid $POUCHDB_PID)"
}

# stop_started stops every process this script started, newest first, by PID: SIGTERM, and
# SIGKILL after 25 s (a consumer lets its running jobs finish for up to SPIEGEL_SHUTDOWN_GRACE,
# 20 s by default: a job retrying a webhook whose receiver stopped first takes that long).
stop_started() {
  local i pid
  for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
    pid=${STARTED_PIDS[$i]}
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 250); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  STARTED_PIDS=()
}
