#!/usr/bin/env bash
# Codec quality on a real model's KV cache, from a fresh clone:
#   tools/real_kv/run.sh            # the full report (docs/quality.md)
#   tools/real_kv/run.sh --ci       # the short, asserted check
# Builds kvcache-tool and kvcache-node into ${BUILD_DIR:-build} when missing,
# sets up the Python environment (setup.sh), runs harness.py. Output:
# ${BUILD_DIR:-build}/real_kv/report.md and report.json.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build}
if [[ ! -x $build/tools/kvcache-tool || ! -x $build/service/kvcache-node ]]; then
  if [[ ! -f $build/build.ninja ]]; then
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DKVCACHE_CUDA=OFF -DKVCACHE_BUILD_BENCH=OFF >/dev/null
  fi
  cmake --build "$build" --target kvcache-tool kvcache-node -j "$(nproc)"
fi
py=$("$root/tools/real_kv/setup.sh")
# numpy on two threads: the harness shares the machine with builds.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}
exec "$py" "$root/tools/real_kv/harness.py" --build "$build" "$@"
