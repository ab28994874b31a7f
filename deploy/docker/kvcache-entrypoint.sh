#!/bin/sh
# kvcache-entrypoint: starts kvcache-node with its memory tier (--memory)
# sized from the environment, then becomes it (exec), so that SIGTERM from
# tini / the kubelet reaches the node and starts its drain.
#
# The first that applies wins:
#   1. a --memory=... argument;
#   2. KVCACHE_MEMORY, passed as is (host:48GiB, gpu:0:60GiB);
#   3. KVCACHE_MEMORY_TIER=host (default): KVCACHE_POOL_PERCENT (default 75)
#      of the container's memory limit: KVCACHE_MEMORY_LIMIT_BYTES (downward
#      API limits.memory in Kubernetes), else the cgroup's memory limit;
#   4. KVCACHE_MEMORY_TIER=gpu: KVCACHE_GPU_POOL_PERCENT (default 80) of the
#      memory of GPU KVCACHE_GPU_INDEX (default 0), read with nvidia-smi.
# Sizes are passed in MiB (host:6144MiB).
set -eu

NODE=${KVCACHE_NODE_BIN:-/usr/local/bin/kvcache-node}
CGROUP_ROOT=${KVCACHE_CGROUP_ROOT:-/sys/fs/cgroup}

die() {
  echo "kvcache-entrypoint: $*" >&2
  exit 64
}

percent() { # percent NAME VALUE
  case $2 in
    '' | *[!0-9]*) die "$1 must be an integer percentage, got '$2'" ;;
  esac
  if [ "$2" -lt 1 ] || [ "$2" -gt 100 ]; then
    die "$1 must be within 1..100, got $2"
  fi
}

for arg in "$@"; do
  case $arg in
    --memory=*) exec "$NODE" "$@" ;;
  esac
done

if [ -n "${KVCACHE_MEMORY:-}" ]; then
  echo "kvcache-entrypoint: --memory=$KVCACHE_MEMORY (KVCACHE_MEMORY)" >&2
  exec "$NODE" "$@" "--memory=$KVCACHE_MEMORY"
fi

case ${KVCACHE_MEMORY_TIER:-host} in
  host)
    pct=${KVCACHE_POOL_PERCENT:-75}
    percent KVCACHE_POOL_PERCENT "$pct"
    limit=${KVCACHE_MEMORY_LIMIT_BYTES:-}
    source="KVCACHE_MEMORY_LIMIT_BYTES"
    if [ -z "$limit" ]; then
      if [ -r "$CGROUP_ROOT/memory.max" ]; then # cgroup v2
        limit=$(cat "$CGROUP_ROOT/memory.max")
        source="$CGROUP_ROOT/memory.max"
      elif [ -r "$CGROUP_ROOT/memory/memory.limit_in_bytes" ]; then # cgroup v1
        limit=$(cat "$CGROUP_ROOT/memory/memory.limit_in_bytes")
        source="$CGROUP_ROOT/memory/memory.limit_in_bytes"
      fi
    fi
    case $limit in
      '' | max | *[!0-9]*)
        die "no memory limit to size the pool from ($source='$limit'): set a memory limit or KVCACHE_MEMORY=host:SIZE" ;;
    esac
    # cgroup v1 reports "unlimited" as a number close to 2^63.
    if [ ${#limit} -gt 16 ]; then
      die "memory limit $limit from $source looks unlimited: set a memory limit or KVCACHE_MEMORY=host:SIZE"
    fi
    mib=$((limit * pct / 100 / 1048576)) # limit < 10^16: no overflow
    [ "$mib" -gt 0 ] || die "pool would be empty: $pct% of $limit bytes"
    mem="host:${mib}MiB"
    echo "kvcache-entrypoint: --memory=$mem ($pct% of $limit bytes from $source)" >&2
    ;;
  gpu)
    idx=${KVCACHE_GPU_INDEX:-0}
    case $idx in '' | *[!0-9]*) die "KVCACHE_GPU_INDEX must be a number, got '$idx'" ;; esac
    pct=${KVCACHE_GPU_POOL_PERCENT:-80}
    percent KVCACHE_GPU_POOL_PERCENT "$pct"
    command -v nvidia-smi > /dev/null 2>&1 ||
      die "nvidia-smi not found (NVIDIA_DRIVER_CAPABILITIES needs 'utility'): set KVCACHE_MEMORY=gpu:$idx:SIZE"
    total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$idx" | head -n 1 | tr -d ' ')
    case $total in '' | *[!0-9]*) die "cannot read the memory of GPU $idx from nvidia-smi: '$total'" ;; esac
    mib=$((total * pct / 100))
    [ "$mib" -gt 0 ] || die "pool would be empty: $pct% of $total MiB"
    mem="gpu:$idx:${mib}MiB"
    echo "kvcache-entrypoint: --memory=$mem ($pct% of GPU $idx's $total MiB)" >&2
    ;;
  *)
    die "KVCACHE_MEMORY_TIER must be host or gpu, got '${KVCACHE_MEMORY_TIER}'"
    ;;
esac

exec "$NODE" "$@" "--memory=$mem"
