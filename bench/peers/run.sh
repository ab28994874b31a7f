#!/usr/bin/env bash
# The peers benchmark: our store (kvcache-node) against Mooncake Store and
# Redis on the same KV workload, on loopback. bench/peers/README.md says
# what it measures, each system's exact path, and the knobs:
#   bench/peers/run.sh                  everything, 3 interleaved rounds
#   QUICK=1 bench/peers/run.sh          a smoke run (64 blocks, 1 round)
#   bench/peers/run.sh first-layer      ours only: time to the first layer
#                                       of a 4,096-token prefix
#                                       (first_layer.py)
#   bench/peers/run.sh profile          ours only: a steady read or write
#                                       loop under perf, its CPU by process
#                                       and category (profile.py)
#   SYSTEMS, PATHS, CODECS, FORMATS, CLIENTS, ROUNDS, BLOCKS, BATCH, OUT,
#   NODE_BIN, PHASE_TIMEOUT, START_TIMEOUT, MOONCAKE_THREADS, KEEP_WORK
# Installs what is missing first, once per machine: Debian's redis-server,
# and a venv outside the clone (PEERS_VENV, default
# ~/.cache/kvcache-peers-venv) holding requirements.txt and our Python
# package built from this tree (rebuilt when the client's sources change).
# Exits 0 when every run finished and every block read was right.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${PEERS_VENV:-$HOME/.cache/kvcache-peers-venv}
node_bin=${NODE_BIN:-$root/build/service/kvcache-node}
# The sources our Python package compiles (python/CMakeLists.txt builds
# kvcache_cluster_client and what it links from them).
client_sources=(python client transport proto kernels base cmake CMakeLists.txt)

log() { echo "peers: $*" >&2; }

# Seconds since the epoch, for the install timings.
now() { date +%s; }

require_node() {
  if [[ ! -x $node_bin ]]; then
    log "no kvcache-node at $node_bin"
    log "build first: cmake -S . -B build -G Ninja && ninja -C build kvcache-node"
    exit 2
  fi
}

# Debian's redis-server, when it is not on PATH.
ensure_redis() {
  command -v redis-server >/dev/null && return
  ((EUID == 0)) || { log "redis-server missing: apt-get install redis-server (as root)"; exit 2; }
  local t
  t=$(now)
  log "installing redis-server (apt-get)"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2
  log "redis-server installed in $(($(now) - t)) s"
}

# The venv and requirements.txt, when the venv is missing or the file changed
# since the last install (its hash is kept in the venv).
ensure_requirements() {
  local want have t
  want=$(sha256sum "$here/requirements.txt" | cut -d' ' -f1)
  have=$(cat "$venv/.peers-requirements" 2>/dev/null || true)
  [[ -x $venv/bin/python && $want == "$have" ]] && return
  t=$(now)
  log "installing requirements.txt into $venv"
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$here/requirements.txt" >&2
  echo "$want" >"$venv/.peers-requirements"
  log "requirements installed in $(($(now) - t)) s ($(du -sh "$venv" | cut -f1) venv)"
}

# A hash of the client's sources as they are in the work tree (tracked files,
# uncommitted changes and untracked files); empty outside a git checkout.
client_fingerprint() {
  git -C "$root" rev-parse --git-dir >/dev/null 2>&1 || return 0
  (
    cd "$root"
    git ls-files -s -- "${client_sources[@]}"
    git diff -- "${client_sources[@]}"
    git ls-files -o --exclude-standard -z -- "${client_sources[@]}" |
      xargs -0 -r sha256sum
  ) | sha256sum | cut -d' ' -f1
}

# Our package (pip install ./python), built in a build folder inside the
# venv (incremental), when it is missing or its sources changed.
ensure_kvcache() {
  local want have t
  want=$(client_fingerprint)
  have=$(cat "$venv/.peers-kvcache" 2>/dev/null || true)
  if "$venv/bin/python" -c 'import kvcache' 2>/dev/null &&
    [[ -z $want || $want == "$have" ]]; then
    return
  fi
  t=$(now)
  log "building our package into $venv (pip install ./python; a few minutes the first time)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps -C build-dir="$venv/kvcache-build" \
    "$root/python" >&2
  echo "$want" >"$venv/.peers-kvcache"
  log "our package built in $(($(now) - t)) s"
}

# Runs the orchestrator; a signal to this script reaches it as SIGTERM, on
# which it stops its servers and clients before it exits.
run_bench() {
  local pid rc=0 script=bench.py
  [[ ${1:-} == first-layer ]] && script=first_layer.py
  [[ ${1:-} == profile ]] && script=profile.py
  NODE_BIN=$node_bin "$venv/bin/python" "$here/$script" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null || true' INT TERM HUP
  wait "$pid" || rc=$?
  if kill -0 "$pid" 2>/dev/null; then # wait was cut short by a trapped signal
    rc=0
    wait "$pid" || rc=$?
  fi
  trap - INT TERM HUP
  return "$rc"
}

require_node
ensure_redis
ensure_requirements
ensure_kvcache
run_bench "$@"
