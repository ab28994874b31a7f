#!/usr/bin/env bash
# Configures and builds the project into ${BUILD_DIR:-build} with Ninja.
# Extra arguments go to cmake (e.g. -DKVCACHE_CUDA=OFF).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build "$build_dir" -j "$(nproc)"
