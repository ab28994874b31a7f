#!/usr/bin/env bash
# End to end on real processes: starts kvcache-node with a tenants file
# (the token hashed by kvcache-tool hash-token), drives the demo workload
# through the client as that tenant (--token-file), pipes /metrics through
# `promtool check metrics` (any finding fails), then sends SIGTERM with idle
# connections open to /metrics and expects a drained exit 0 within
# --drain-timeout + 1 s.
# Usage: node_process_test.sh BIN_DIR
set -euo pipefail
bin_dir=$1
work=$(mktemp -d)
node_pid=
cleanup() {
  if [[ -n $node_pid ]] && kill -0 "$node_pid" 2>/dev/null; then
    kill -KILL "$node_pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "node-process-test-token" >"$work/token"
cat >"$work/tenants.textproto" <<EOF
tenants {
  name: "demo"
  token_sha256: "$("$bin_dir/tools/kvcache-tool" hash-token --token-file "$work/token")"
  namespace_prefixes: "demo-"
  role: ROLE_WRITE
}
EOF
"$bin_dir/service/kvcache-node" --listen=127.0.0.1:0 \
  --metrics-listen=127.0.0.1:0 --health-listen=127.0.0.1:0 \
  --memory=host:512MiB --page-size=16KiB --drain-timeout=5 \
  --tenants="$work/tenants.textproto" 2>"$work/node.log" &
node_pid=$!
for _ in $(seq 1 100); do
  grep -q "serving gRPC" "$work/node.log" && break
  sleep 0.1
done
grpc_port=$(sed -n 's/.*serving gRPC on port \([0-9]*\).*/\1/p' "$work/node.log")
metrics_port=$(sed -n 's/.*metrics on port \([0-9]*\).*/\1/p' "$work/node.log")
[[ -n $grpc_port && -n $metrics_port ]] || { cat "$work/node.log"; exit 1; }
if grep -q "running open" "$work/node.log"; then
  echo "a node with --tenants says it runs open"; exit 1
fi

timeout 300 "$bin_dir/tools/kvcache-demo" --node="127.0.0.1:$grpc_port" \
  --metrics="127.0.0.1:$metrics_port" --conversations=3 --turns=2 \
  --token-file="$work/token" | tee "$work/demo.txt"
grep -q "quantization buys" "$work/demo.txt"
# The same workload in bf16 (its own namespaces), every read checked.
timeout 300 "$bin_dir/tools/kvcache-demo" --node="127.0.0.1:$grpc_port" \
  --metrics="127.0.0.1:$metrics_port" --conversations=2 --turns=1 \
  --token-file="$work/token" --dtype=bf16 | tee "$work/demo-bf16.txt"
grep -q "bf16 MiB" "$work/demo-bf16.txt"
grep -q "^wrong reads: 0$" "$work/demo-bf16.txt"

curl -sf --max-time 10 "http://127.0.0.1:$metrics_port/metrics" >"$work/metrics.txt"
for name in kvcache_pool_capacity_bytes kvcache_token_capacity_remaining \
    kvcache_requests_total kvcache_blocks kvcache_stored_tokens; do
  grep -q "^$name" "$work/metrics.txt" || { echo "missing $name"; exit 1; }
done
grep -q 'kvcache_requests_total{code="OK",op="commit_write",tenant="demo"}' \
  "$work/metrics.txt" || { echo "no requests of tenant demo"; exit 1; }
findings=$(promtool check metrics <"$work/metrics.txt" 2>&1) || {
  echo "promtool check metrics failed:"; echo "$findings"; exit 1; }
if [[ -n $findings ]]; then
  echo "promtool check metrics findings:"; echo "$findings"; exit 1
fi
echo "promtool check metrics: clean ($(grep -vc '^#' "$work/metrics.txt") samples)"

# Connections that never send a request (a scanner, a stuck scraper) must
# not hold the exit past the drain.
exec 3<>"/dev/tcp/127.0.0.1/$metrics_port" 4<>"/dev/tcp/127.0.0.1/$metrics_port"
sleep 0.2
term_at=$(date +%s%N)
kill -TERM "$node_pid"
rc=0
timeout 30 tail --pid="$node_pid" -f /dev/null || rc=$?
wait "$node_pid" || rc=$?
exit_ms=$(( ($(date +%s%N) - term_at) / 1000000 ))
node_pid=
exec 3>&- 4>&-
grep -q "drained" "$work/node.log" || { cat "$work/node.log"; exit 1; }
[[ $rc -eq 0 ]] || { echo "node exited $rc after SIGTERM"; exit 1; }
(( exit_ms <= 6000 )) || {
  echo "node took $exit_ms ms to exit after SIGTERM (--drain-timeout=5):"
  tail -5 "$work/node.log"; exit 1; }
echo "SIGTERM: drained, exit 0 after $exit_ms ms"

