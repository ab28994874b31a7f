#!/usr/bin/env bash
# Self-test of the observability harness (scripts/observe.sh --test and
# tests/deploy/observe_test.py) with stand-in nodes
# (tests/deploy/fake_kvcache_node.py) and a real Prometheus. It checks the
# harness, the shipped scrape config and the queries, not the node: the real
# run is `scripts/observe.sh --test` with the built binaries.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=$(mktemp -d)
trap 'rm -rf "$BIN"' EXIT
cp tests/deploy/fake_kvcache_node.py "$BIN/kvcache-node"
chmod +x "$BIN/kvcache-node"
# Writes spread over a few seconds, so that scrapes see the gauges move.
# shellcheck disable=SC2016 # expanded by the bash that runs the load
load='for i in 1 2 3 4 5 6; do for a in ${KVCACHE_NODES//,/ }; do
        curl -fsS -X POST "http://$a/write?tokens=512&namespace=selftest" || exit 1; done; sleep 0.5; done'
KVCACHE_BIN_DIR=$BIN KVCACHE_LOAD_CMD=$load \
  scripts/observe.sh --test --nodes 3 --base-port "${SELFTEST_BASE_PORT:-27700}" --prom-port "${SELFTEST_PROM_PORT:-29090}"
