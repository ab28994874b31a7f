#!/usr/bin/env bash
# Runs the example workload of the never-wrong-KV issue (a prefill worker,
# then at once a decode worker, on a fresh node with the UCX data plane)
# ROUNDS times for each codec and transport, and counts the runs whose
# decode worker found a non-finite element or a block in no legal state
# (it checks every loaded block bit for bit and exits 1 then).
#   ROUNDS (default 50: the issue's figure) per codec x transport
#   CODECS (default "kivi2 kivi4 fp8_e4m3"), TRANSPORTS ("tcp shm")
#   FORMATS (default "fp16 raw"), PROMPT_TOKENS (16384)
#   DTYPES (default "fp16"; "fp16 bf16": the engine's KV dtype, each run
#   takes the next in turn)
#   NODE_BIN (default the build's kvcache-node: another node to try)
# Prints one line per run and a summary; exits non-zero on any failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
rounds=${ROUNDS:-50}
codecs=${CODECS:-kivi2 kivi4 fp8_e4m3}
transports=${TRANSPORTS:-tcp shm}
formats=${FORMATS:-fp16 raw}
read -r -a format_list <<<"$formats"
read -r -a dtype_list <<<"${DTYPES:-fp16}"
tokens=${PROMPT_TOKENS:-16384}
for bin in service/kvcache-node client/examples/kvcache-prefill_worker \
  client/examples/kvcache-decode_worker; do
  [[ -x $build/$bin ]] || { echo "repro: build $build/$bin first" >&2; exit 2; }
done
node_bin=${NODE_BIN:-$build/service/kvcache-node}
work=$(mktemp -d)
node_pid=
cleanup() {
  [[ -n $node_pid ]] && kill -TERM "$node_pid" 2>/dev/null && wait "$node_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
export UCX_NET_DEVICES=lo

runs=0 failed=0 nonfinite=0 wrong=0
for transport in $transports; do
  case $transport in
    # shm: the node's default data plane (no TCP, no listener). With tcp in
    # the clients' list their endpoints get tcp lanes, and reads travel as
    # tcp data messages (docs/benchmarks.md, "Peers").
    tcp) export UCX_TLS=tcp; node_plane=(--ucx-tcp-trusted-network=true --ucx-listen=127.0.0.1:0) ;;
    shm) export UCX_TLS=posix,sysv,self; node_plane=() ;;
    *) echo "repro: unknown transport $transport" >&2; exit 2 ;;
  esac
  for codec in $codecs; do
    for round in $(seq 1 "$rounds"); do
      format=${format_list[$(( (round - 1) % ${#format_list[@]} ))]}
      dtype=${dtype_list[$(( (round - 1) % ${#dtype_list[@]} ))]}
      log=$work/node.log
      # Created here, not by the node's redirection: the loop below may read
      # it before the background shell has opened it (under set -e a sed of
      # a missing file ended the whole script).
      : >"$log"
      "$node_bin" --listen=127.0.0.1:0 --metrics-listen= \
        --memory=host:1GiB --data-plane=ucx "${node_plane[@]}" \
        2>"$log" &
      node_pid=$!
      port=
      for _ in $(seq 1 200); do
        port=$(sed -n 's/.*serving gRPC on port \([0-9]*\).*/\1/p' "$log" | head -1)
        [[ -n $port ]] && break
        sleep 0.05
      done
      [[ -n $port ]] || { cat "$log"; echo "repro: node did not start" >&2; exit 1; }
      args=(--nodes="127.0.0.1:$port" --codec="$codec" --dtype="$dtype"
        --prompt-tokens="$tokens")
      rc=0
      "$build/client/examples/kvcache-prefill_worker" "${args[@]}" \
        >"$work/prefill.out" 2>&1 || rc=$?
      if ((rc == 0)); then
        "$build/client/examples/kvcache-decode_worker" "${args[@]}" \
          --format="$format" >"$work/decode.out" 2>&1 || rc=$?
      fi
      kill -TERM "$node_pid" 2>/dev/null || true
      wait "$node_pid" 2>/dev/null || true
      node_pid=
      runs=$((runs + 1))
      states=$(grep -o 'legal states: .*' "$work/decode.out" 2>/dev/null || true)
      w=$(echo "$states" | sed -n 's/.* \([0-9]*\) wrong.*/\1/p')
      n=$(echo "$states" | sed -n 's/.*; \([0-9]*\) non-finite.*/\1/p')
      wrong=$((wrong + ${w:-0}))
      nonfinite=$((nonfinite + ${n:-0}))
      if ((rc != 0)) || [[ -z $states ]]; then
        failed=$((failed + 1))
        echo "run $runs $transport $codec $dtype $format: FAILED (rc $rc)"
        cat "$work/prefill.out" "$work/decode.out" 2>/dev/null | tail -5
      else
        echo "run $runs $transport $codec $dtype $format: ok ($states)"
      fi
    done
  done
done
echo "repro: $runs runs, $failed failed; $wrong blocks in no legal state, $nonfinite non-finite elements"
((failed == 0))
