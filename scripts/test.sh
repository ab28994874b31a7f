#!/usr/bin/env bash
# The whole test suite from a fresh Debian 12 machine: installs what is
# missing, builds, runs every ctest test (unit, integration, process and
# metrics tests), the store stress test under ThreadSanitizer, a local
# observability run (real nodes, a real Prometheus, asserted by a test) and
# the offline deployment checks. Exits non-zero on any failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)

"$root/scripts/install-deps.sh"
if ! python3 -c "import numpy" 2>/dev/null; then
  echo "== pip install -r tests/requirements.txt"
  python3 -m pip install -q --disable-pip-version-check -r "$root/tests/requirements.txt" ||
    python3 -m pip install -q --disable-pip-version-check --break-system-packages \
      -r "$root/tests/requirements.txt"
fi

echo "== build"
"$root/scripts/build.sh"

echo "== ctest"
(cd "$root/build" && ctest --output-on-failure -j "$(nproc)" --timeout 600)

echo "== ThreadSanitizer: store stress test"
cmake -S "$root" -B "$root/build-tsan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVCACHE_TSAN=ON -DKVCACHE_CUDA=OFF -DKVCACHE_BUILD_BENCH=OFF >/dev/null
cmake --build "$root/build-tsan" -j "$(nproc)" --target store_test
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  "$root/build-tsan/tests/store_test" --gtest_brief=1

echo "== observability: real nodes scraped by a real Prometheus"
metrics_file=$(mktemp)
trap 'rm -f "$metrics_file"' EXIT
"$root/scripts/observe.sh" --test --save-metrics "$metrics_file"

echo "== deployment checks (against the metrics of a real node)"
KVCACHE_DEPLOY_SKIP_OBSERVE=1 "$root/scripts/deploy-check.sh" "$metrics_file"

echo "== all tests passed in $(( $(date +%s) - start )) s"
