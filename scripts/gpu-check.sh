#!/usr/bin/env bash
# GPU check of the codecs (issue 3): builds the kernels with CUDA, checks the
# CUDA codecs bit for bit against the scalar reference, runs the CPU codec
# tests too, then measures every codec's bandwidth against a device-to-device
# copy on the same card and prints the table.
#
#   scripts/gpu-check.sh [kvcache_gpu_bench flags, e.g. --blocks 512]
#
# Environment: BUILD_DIR (default build-gpu-check), CUDA_ARCH (default: the
# first device's compute capability, else 90), JOBS (default: nproc).
# Only kernels/ is built (a small CMake project that includes kernels/), so
# the node's dependencies (gRPC, UCX, ...) are not needed on the GPU machine:
# CMake, Ninja or Make, a C++17 compiler, Abseil, Highway, GoogleTest, CUDA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-gpu-check}"
JOBS="${JOBS:-$(nproc)}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"

if [[ ! -x "$NVCC" ]]; then
  echo "gpu-check: no nvcc (looked for $NVCC)" >&2
  exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU visible to nvidia-smi; the CUDA tests would only be skipped" >&2
  exit 2
fi
if [[ -z "${CUDA_ARCH:-}" ]]; then
  CUDA_ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
    head -n1 | tr -d ' .')"
  CUDA_ARCH="${CUDA_ARCH:-90}"
fi

echo "== GPU"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
"$NVCC" --version | tail -n1

# A CMake project holding only kernels/ (the top level also needs gRPC etc.).
SRC="$BUILD_DIR/project"
mkdir -p "$SRC"
cat >"$SRC/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.22)
project(kvcache_gpu_check LANGUAGES C CXX CUDA)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(hwy CONFIG REQUIRED)
find_package(GTest REQUIRED)
find_package(CUDAToolkit REQUIRED)
set(KVCACHE_HAVE_CUDA ON)
set(KVCACHE_BUILD_TESTS ON)
set(KVCACHE_WARNINGS -Wall -Wextra -Werror -Wno-unused-parameter)
enable_testing()
add_subdirectory("$ROOT/kernels" kernels)
CMAKE

GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
echo "== configure (CUDA arch $CUDA_ARCH)"
cmake -S "$SRC" -B "$BUILD_DIR/out" "${GENERATOR[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" >/dev/null
echo "== build"
cmake --build "$BUILD_DIR/out" -j "$JOBS" \
  --target kernels_test kernels_cuda_test kvcache_gpu_bench

echo "== CPU codecs (scalar reference, SIMD on every target of this CPU)"
"$BUILD_DIR/out/kernels/kernels_test" --gtest_brief=1

echo "== CUDA codecs vs the scalar reference (bit for bit)"
# A skip here means the test binary saw no device: that is a failure of
# this check, not a pass.
CUDA_LOG="$BUILD_DIR/cuda_test.log"
"$BUILD_DIR/out/kernels/kernels_cuda_test" 2>&1 | tee "$CUDA_LOG" | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) ' || true
if grep -q '^\[  FAILED  \]' "$CUDA_LOG"; then
  echo "gpu-check: CUDA codec tests FAILED (full log: $CUDA_LOG)" >&2
  exit 1
fi
if grep -q '^\[  SKIPPED \]' "$CUDA_LOG"; then
  echo "gpu-check: CUDA codec tests were SKIPPED: no device seen" >&2
  exit 1
fi

echo "== bandwidth"
"$BUILD_DIR/out/kernels/kvcache_gpu_bench" "$@"
