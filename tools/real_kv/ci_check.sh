#!/usr/bin/env bash
# The CI check of scripts/test.sh: the harness's short version (384 cached
# tokens, 128 decode tokens, codecs none, fp8_e4m3 and kivi2 through a real
# node, `kvcache-tool eval` on layers 0, 1 and 15) with the bounds of
# report.py's CI_BOUNDS asserted. Expects kvcache-tool and kvcache-node in
# ${BUILD_DIR:-build}.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
start=$(date +%s)
"$root/tools/real_kv/run.sh" --ci
echo "   quality check: $(( $(date +%s) - start )) s"
