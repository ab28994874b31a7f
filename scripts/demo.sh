#!/usr/bin/env bash
# The main job from a fresh Debian 12 machine: installs what is missing,
# builds, starts a kvcache node on host memory and runs a realistic
# serving workload against it (shared system prompts, multi-turn chats,
# one namespace per codec), then prints what the node stores and what
# quantization bought. The node keeps running for a look at /metrics when
# KEEP_NODE=1; otherwise it is drained with SIGTERM at the end.
# The node runs with a tenants file written to a temporary directory, and
# the demo calls it with that tenant's bearer token (--token-file).
# Environment: NODE_MEMORY (default host:2GiB), GRPC_PORT (50051),
# METRICS_PORT (9464), DEMO_ARGS (extra kvcache-demo flags).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" >/dev/null
echo "demo: build done"

memory=${NODE_MEMORY:-host:2GiB}
grpc_port=${GRPC_PORT:-50051}
metrics_port=${METRICS_PORT:-9464}
log=$(mktemp)
# The node runs with tenants: one "demo" tenant owning the demo's
# namespaces, its token made here and passed to the demo as a file (the
# tenants file holds only its SHA-256).
secrets=$(mktemp -d)
head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$secrets/demo.token"
token_sha256=$("$root/build/tools/kvcache-tool" hash-token \
  --token-file "$secrets/demo.token")
cat >"$secrets/tenants.textproto" <<EOF
tenants {
  name: "demo"
  token_sha256: "$token_sha256"
  namespace_prefixes: "demo-"
  role: ROLE_WRITE
}
EOF
"$root/build/service/kvcache-node" --listen="127.0.0.1:$grpc_port" \
  --metrics-listen="127.0.0.1:$metrics_port" --memory="$memory" \
  --page-size=16KiB --tenants="$secrets/tenants.textproto" 2>"$log" &
node_pid=$!
trap 'kill -TERM $node_pid 2>/dev/null || true; rm -rf "$secrets"' EXIT
for _ in $(seq 1 100); do
  grep -q "serving gRPC" "$log" && break
  kill -0 "$node_pid" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
cat "$log"
# shellcheck disable=SC2086
"$root/build/tools/kvcache-demo" --node="127.0.0.1:$grpc_port" \
  --metrics="127.0.0.1:$metrics_port" --token-file="$secrets/demo.token" \
  ${DEMO_ARGS:-}
echo
echo "a few of the node's metrics:"
curl -sf "http://127.0.0.1:$metrics_port/metrics" |
  grep -E '^kvcache_(pool_used_ratio|blocks|token_capacity_remaining\{codec="(none|fp8_e4m3|kivi2)",kv_namespace="demo-llama/none"|lookup_blocks_total)' || true
if [[ ${KEEP_NODE:-0} == 1 ]]; then
  trap - EXIT
  echo "node still running (pid $node_pid): http://127.0.0.1:$metrics_port/metrics; stop it with kill $node_pid"
  echo "its tenants file and the demo's token: $secrets"
fi
