#!/usr/bin/env bash
# Tests deploy/docker/kvcache-entrypoint.sh with a stand-in node binary (it
# prints its arguments) and a stand-in nvidia-smi: the --memory it computes
# from the environment, and the errors it refuses to start with.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
EP=deploy/docker/kvcache-entrypoint.sh
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
printf '#!/bin/sh\necho "$@"\n' > "$T/node"
mkdir -p "$T/bin" "$T/cg2" "$T/cg1/memory" "$T/none"
printf '#!/bin/sh\necho "81559"\n' > "$T/bin/nvidia-smi"
chmod +x "$T/node" "$T/bin/nvidia-smi"
echo 8589934592 > "$T/cg2/memory.max"
echo 9223372036854771712 > "$T/cg1/memory/memory.limit_in_bytes"
passed=0
failed=0

run() { # run ENV... -- ARGS...: prints the entrypoint's stdout, returns its status
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  env -i PATH="/usr/bin:/bin" KVCACHE_NODE_BIN="$T/node" KVCACHE_CGROUP_ROOT="$T/none" "${envs[@]}" sh "$EP" "$@" 2> "$T/stderr"
}

expect() { # expect NAME WANT ENV... -- ARGS...
  local name=$1 want=$2
  shift 2
  local got
  got=$(run "$@")
  if [[ $? == 0 && $got == "$want" ]]; then
    passed=$((passed + 1))
    echo "ok   $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name: got '$got', want '$want'; stderr: $(cat "$T/stderr")"
  fi
}

expect_error() { # expect_error NAME STDERR-SUBSTRING ENV... -- ARGS...
  local name=$1 want=$2
  shift 2
  if run "$@" > /dev/null; then
    failed=$((failed + 1))
    echo "FAIL $name: started, want an error"
  elif grep -q -- "$want" "$T/stderr"; then
    passed=$((passed + 1))
    echo "ok   $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name: stderr '$(cat "$T/stderr")' lacks '$want'"
  fi
}

C=--config=/etc/kvcache/node.flags
expect "host tier from the downward API limit" "$C --memory=host:6144MiB" \
  KVCACHE_MEMORY_LIMIT_BYTES=8589934592 -- "$C"
expect "host tier, other percentage" "$C --memory=host:4096MiB" \
  KVCACHE_MEMORY_LIMIT_BYTES=8589934592 KVCACHE_POOL_PERCENT=50 -- "$C"
expect "host tier from cgroup v2 memory.max" "$C --memory=host:6144MiB" \
  KVCACHE_CGROUP_ROOT="$T/cg2" -- "$C"
expect "gpu tier from nvidia-smi" "$C --memory=gpu:0:65247MiB" \
  PATH="$T/bin:/usr/bin:/bin" KVCACHE_MEMORY_TIER=gpu -- "$C"
expect "gpu tier, index and percentage" "$C --memory=gpu:1:40779MiB" \
  PATH="$T/bin:/usr/bin:/bin" KVCACHE_MEMORY_TIER=gpu KVCACHE_GPU_INDEX=1 KVCACHE_GPU_POOL_PERCENT=50 -- "$C"
expect "KVCACHE_MEMORY wins" "$C --memory=gpu:0:60GiB" \
  KVCACHE_MEMORY=gpu:0:60GiB KVCACHE_MEMORY_LIMIT_BYTES=8589934592 -- "$C"
expect "a --memory argument wins" "$C --memory=host:1GiB" \
  KVCACHE_MEMORY=gpu:0:60GiB -- "$C" --memory=host:1GiB
expect_error "no limit anywhere" "no memory limit" -- "$C"
expect_error "cgroup v1 unlimited" "looks unlimited" KVCACHE_CGROUP_ROOT="$T/cg1" -- "$C"
expect_error "bad percentage" "within 1..100" KVCACHE_MEMORY_LIMIT_BYTES=8589934592 KVCACHE_POOL_PERCENT=150 -- "$C"
expect_error "gpu tier without nvidia-smi" "nvidia-smi not found" KVCACHE_MEMORY_TIER=gpu -- "$C"
expect_error "unknown tier" "must be host or gpu" KVCACHE_MEMORY_TIER=disk -- "$C"

echo "entrypoint: $passed passed, $failed failed"
((failed == 0))
