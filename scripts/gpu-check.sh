#!/usr/bin/env bash
# The GPU check (issue 19), run from the bundle that scripts/gpu-bundle.sh
# builds, on a machine with nothing of ours installed:
#
#   gpu-bundle/gpu-check.sh            # on the GPU machine
#   scripts/gpu-check.sh               # here: builds the bundle, then runs it
#
# Steps, each under `timeout`, about 5 minutes in all:
#   probe       CUDA's own answer (a GPU that nvidia-smi lists but CUDA does
#               not reach is a FAIL with CUDA's reason, never a skip)
#   codecs      CUDA codecs bit for bit against the scalar reference
#   device      the device client's tests (Put from and reads into GPU memory)
#   store       the store on a GPU arena (StoreGpu*: reads equal a host
#               arena's; a host arena is not pinned at start)
#   node        a node on --memory=gpu:0:SIZE, then on host memory, each
#               under a real workload for every codec (kvcache-demo, and the
#               prefill/decode examples for kivi2 and fp8) over gRPC, UCX
#               tcp and UCX shared memory, every read checked bit for bit
#   soak        kvcache-soak with its nodes on GPU memory
#   throughput  kvcache-bench put/get against a GPU node and a host node
#   kernels     kvcache_gpu_bench: every codec against a device copy
#   memcheck    compute-sanitizer memcheck on the codec tests
# On a machine without a GPU, each GPU step reports "no device" and the host
# steps (the host node, the device client's host fallbacks) must pass.
#
# Prints one table and writes it to $GPU_CHECK_REPORT (default
# ./gpu-check.txt); step logs go to $GPU_CHECK_LOGS (default a temp folder).
# KVCACHE_EXEC prefixes every bundled binary (the bundle's isolated-root
# check runs them under chroot). GPU_NODE_MEMORY (default gpu:0:8GiB).
# GPU_CHECK_STEPS runs only the steps named (default: all of the above);
# SOAK_SECONDS (default 40).
# Exit status 0 when no step failed.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ ! -d $here/bin ]]; then
  root=$(cd "$here/.." && pwd)
  "$root/scripts/gpu-bundle.sh" "$root/gpu-bundle" || exit 1
  exec "$root/gpu-bundle/gpu-check.sh" "$@"
fi
B=$here
export LD_LIBRARY_PATH=$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
read -r -a X <<<"${KVCACHE_EXEC:-}"
report=${GPU_CHECK_REPORT:-$PWD/gpu-check.txt}
logs=${GPU_CHECK_LOGS:-$(mktemp -d)}
mkdir -p "$logs"
gpu_memory=${GPU_NODE_MEMORY:-gpu:0:8GiB}
export UCX_NET_DEVICES=lo
steps=" ${GPU_CHECK_STEPS:-codecs device store node-gpu node-host soak throughput kernels memcheck} "
want() { [[ $steps == *" $1 "* ]]; }
rows=()
failed=0
t0=$(date +%s)

# row STEP RESULT DETAIL
row() {
  rows+=("$(printf '| %-10s | %-9s | %s |' "$1" "$2" "$3")")
  [[ $2 == FAIL ]] && failed=$((failed + 1))
  echo "-- $1: $2 $3 ($(($(date +%s) - t0)) s)"
}
# gtest_counts LOG: "P passed, S skipped, F failed"
gtest_counts() {
  local p s f
  p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$1" | tail -1)
  s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$1" | tail -1)
  f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$1" | tail -1)
  echo "${p:-0} passed, ${s:-0} skipped, ${f:-0} failed"
}

echo "== machine"
cat "$B/BUNDLE" 2>/dev/null
listed=""
if command -v nvidia-smi >/dev/null 2>&1; then
  listed=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
fi
probe=$(timeout 30 "${X[@]}" "$B/bin/kvcache_gpu_bench" --probe 2>&1)
probe_rc=$?
echo "nvidia-smi: ${listed:-no GPU listed}"
echo "$probe"
gpu=0
if ((probe_rc == 0)); then
  gpu=1
  row probe PASS "${listed:-$probe}; $probe"
elif [[ -n $listed ]]; then
  row probe FAIL "nvidia-smi lists $listed but $probe"
else
  row probe "no device" "$probe"
fi
# gpu_step NAME: true when a GPU step should run; records "no device" else.
gpu_step() {
  ((gpu)) && return 0
  if [[ -n $listed ]]; then row "$1" FAIL "CUDA does not reach the GPU"; else row "$1" "no device" "skipped: no GPU"; fi
  return 1
}

# gtest_gpu_step STEP TIMEOUT BINARY [ARGS]: a test binary whose every test
# needs a device: with one, a skip is a failure; without, "no device".
gtest_gpu_step() {
  local step=$1 limit=$2 bin=$3 rc
  shift 3
  local log=$logs/$step.log
  timeout "$limit" "${X[@]}" "$B/bin/$bin" "$@" >"$log" 2>&1
  rc=$?
  if ((rc != 0)); then
    row "$step" FAIL "exit $rc: $(gtest_counts "$log") (log $log)"
  elif ((gpu)) && grep -q '^\[  SKIPPED \] [0-9]' "$log"; then
    row "$step" FAIL "tests skipped with a device: $(gtest_counts "$log")"
  elif ((gpu)); then
    row "$step" PASS "$(gtest_counts "$log")"
  else
    row "$step" "no device" "$(gtest_counts "$log")"
  fi
}

if want codecs; then
  echo "== codecs: CUDA vs the scalar reference"
  gtest_gpu_step codecs 120 kernels_cuda_test
fi

if want device; then
  echo "== device client"
  log=$logs/device.log
  timeout 180 "${X[@]}" "$B/bin/device_client_test" >"$log" 2>&1
  rc=$?
  # With a device, the one test that may skip is the no-device path's.
  unexpected=$(grep -c 'needs a CUDA device' "$log")
  if ((rc != 0)); then
    row device FAIL "exit $rc: $(gtest_counts "$log") (log $log)"
  elif ((gpu && unexpected > 0)); then
    row device FAIL "$unexpected device tests skipped with a device"
  else
    row device PASS "$(gtest_counts "$log")$( ((gpu)) || echo '; device tests: no device')"
  fi
fi

if want store; then
  echo "== store on a GPU arena"
  gtest_gpu_step store 120 store_test --gtest_filter='*StoreGpu*'
fi

node_pid=
stop_node() {
  [[ -n $node_pid ]] || return 0
  kill -TERM "$node_pid" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$node_pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$node_pid" 2>/dev/null
  wait "$node_pid" 2>/dev/null
  node_pid=
}
trap stop_node EXIT
# start_node LOG MEMORY PLANE: sets node_addr, or returns 1.
start_node() {
  local log=$1 memory=$2 plane=$3 args=()
  case $plane in
    grpc) args=(--data-plane=none) ;;
    tcp) args=(--data-plane=ucx --ucx-tcp-trusted-network=true --ucx-listen=127.0.0.1:0) ;;
    shm) args=(--data-plane=ucx) ;;
  esac
  "${X[@]}" "$B/bin/kvcache-node" --listen=127.0.0.1:0 --metrics-listen= \
    --memory="$memory" --page-size=16KiB "${args[@]}" >"$log" 2>&1 &
  node_pid=$!
  for _ in $(seq 1 300); do
    node_addr=$(sed -n 's/.*serving gRPC on port \([0-9]*\).*/127.0.0.1:\1/p' "$log" | head -1)
    [[ -n $node_addr ]] && return 0
    kill -0 "$node_pid" 2>/dev/null || { node_pid=; return 1; }
    sleep 0.1
  done
  stop_node
  return 1
}
plane_env() {
  case $1 in
    tcp) echo UCX_TLS=tcp ;;
    shm) echo UCX_TLS=posix,sysv,cma,self ;;
    grpc) echo UCX_TLS= ;;
  esac
}
# workload MEMORY: every codec through each plane; prints "ok ..." or why not.
workload() {
  local memory=$1 plane out blocks=0 why=""
  for plane in grpc tcp shm; do
    local tag=${memory%%:*}-$plane
    if ! start_node "$logs/node-$tag.log" "$memory" "$plane"; then
      echo "the node did not start on $memory: $(tail -1 "$logs/node-$tag.log")"
      return 1
    fi
    out=$logs/demo-$tag.log
    if ! env "$(plane_env "$plane")" timeout 90 "${X[@]}" "$B/bin/kvcache-demo" \
      --node="$node_addr" --conversations=6 --turns=3 >"$out" 2>&1; then
      why="kvcache-demo on $tag failed: $(tail -1 "$out")"
    fi
    local codec
    for codec in kivi2 fp8_e4m3; do
      [[ -n $why ]] && break
      local a=(--nodes="$node_addr" --codec="$codec" --prompt-tokens=4096)
      out=$logs/examples-$tag-$codec.log
      if ! env "$(plane_env "$plane")" timeout 60 "${X[@]}" "$B/bin/kvcache-prefill_worker" "${a[@]}" >"$out" 2>&1 ||
        ! env "$(plane_env "$plane")" timeout 60 "${X[@]}" "$B/bin/kvcache-decode_worker" "${a[@]}" --format=fp16 >>"$out" 2>&1; then
        why="examples $codec on $tag failed: $(tail -1 "$out")"
      fi
      local n
      n=$(sed -n 's/.*legal states: \([0-9]*\) blocks as written, \([0-9]*\) as.*/\1+\2/p' "$out" | head -1)
      blocks=$((blocks + ${n:-0}))
    done
    stop_node
    [[ -n $why ]] && { echo "$why"; return 1; }
  done
  echo "demo (5 codecs) and examples (kivi2, fp8) over grpc, tcp, shm: every read verified ($blocks example blocks checked)"
}

echo "== node on GPU memory, then on host memory"
if want node-gpu && gpu_step node-gpu; then
  if detail=$(workload "$gpu_memory"); then row node-gpu PASS "$detail"; else row node-gpu FAIL "$detail"; fi
fi
if want node-host; then
  if detail=$(workload host:2GiB); then row node-host PASS "$detail"; else row node-host FAIL "$detail"; fi
fi

echo "== soak on GPU memory"
if want soak && gpu_step soak; then
  log=$logs/soak.log
  timeout 120 "${X[@]}" "$B/bin/kvcache-soak" --duration="${SOAK_SECONDS:-40}" --node-bin="$B/bin/kvcache-node" \
    --node-memory=gpu:0:64MiB >"$log" 2>&1
  rc=$?
  if ((rc == 0)); then row soak PASS "$(grep -E 'verified|wrong' "$log" | tail -1)"; else row soak FAIL "exit $rc: $(tail -1 "$log")"; fi
fi

echo "== throughput: GPU arena against host arena (UCX shm, 1 MiB blocks, 4 streams)"
# bench MEMORY: prints "put P / get G MiB/s".
bench() {
  local tag=${1%%:*} out
  out=$logs/bench-$tag.log
  start_node "$logs/node-bench-$tag.log" "$1" shm || { echo "node did not start"; return 1; }
  env UCX_TLS=posix,sysv,cma,self timeout 120 "${X[@]}" "$B/bin/kvcache-bench" --node="$node_addr" \
    --no-perftest --seconds=2 --runs=3 --streams=4 --sizes=1MiB >"$out" 2>&1
  local rc=$?
  stop_node
  ((rc == 0)) || { echo "exit $rc: $(tail -1 "$out")"; return 1; }
  awk '$1 == "put" || $1 == "get" {printf "%s %s MiB/s %s; ", $1, $5, $6}' "$out"
}
if want throughput && gpu_step throughput; then
  h=
  if g=$(bench "$gpu_memory") && h=$(bench host:4GiB); then row throughput PASS "gpu: $g || host: $h"; else row throughput FAIL "gpu: $g host: ${h:-}"; fi
fi

echo "== kernels"
if want kernels && gpu_step kernels; then
  log=$logs/kernels.log
  timeout 150 "${X[@]}" "$B/bin/kvcache_gpu_bench" >"$log" 2>&1
  rc=$?
  cat "$log"
  if ((rc == 0)); then row kernels PASS "$(grep -m1 'cudaMemcpy' "$log"); table below"; else row kernels FAIL "exit $rc: $(tail -1 "$log")"; fi
fi

echo "== memcheck"
if want memcheck && gpu_step memcheck; then
  sanitizer=$(command -v compute-sanitizer)
  for s in /usr/local/cuda*/bin/compute-sanitizer; do
    [[ -z $sanitizer && -x $s ]] && sanitizer=$s
  done
  log=$logs/memcheck.log
  if [[ -z $sanitizer ]]; then
    row memcheck "not run" "compute-sanitizer is not on this machine"
  else
    timeout "${MEMCHECK_SECONDS:-150}" "$sanitizer" --tool memcheck --error-exitcode 9 "$B/bin/kernels_cuda_test" \
      --gtest_filter='-*EveryPattern*' >"$log" 2>&1
    rc=$?
    summary=$(grep -m1 'ERROR SUMMARY' "$log")
    if ((rc == 0)); then row memcheck PASS "${summary:-no summary}; $(gtest_counts "$log")"
    elif ((rc == 124)); then row memcheck FAIL "timed out after ${MEMCHECK_SECONDS:-150} s"
    else row memcheck FAIL "exit $rc: ${summary:-$(tail -1 "$log")}"; fi
  fi
fi

{
  echo "kvcache GPU check, $(date -u +%FT%TZ), $(($(date +%s) - t0)) s"
  head -2 "$B/BUNDLE" 2>/dev/null
  echo
  echo "| step       | result    | detail |"
  echo "|------------|-----------|--------|"
  printf '%s\n' "${rows[@]}"
  if [[ -f $logs/kernels.log ]]; then echo; grep -E '^(\||device|block)' "$logs/kernels.log"; fi
} >"$report"
echo
cat "$report"
echo "(report: $report; logs: $logs)"
((failed == 0))
