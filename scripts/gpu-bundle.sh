#!/usr/bin/env bash
# Builds the GPU check's bundle: every binary scripts/gpu-check.sh runs,
# built here for sm_90 (Hopper) with the static CUDA runtime, stripped, with
# the shared libraries they link (their ldd closure, less glibc, libstdc++,
# libgcc_s and the driver's libcuda, which the GPU machine has) and UCX's
# transport modules. The folder runs on a bare CUDA machine with no Debian
# packages and no network:
#
#   scripts/gpu-bundle.sh [OUT_DIR]      # default: gpu-bundle/ in the clone
#   OUT_DIR/gpu-check.sh                 # on the GPU machine
#
# Environment: BUILD_DIR (default build: the main build, configured with
# -DKVCACHE_CUDA=ON and sm_90 when it is not already), JOBS (default nproc),
# MAX_MIB (default 60: the device tool carries 64 MiB in all).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/gpu-bundle}
build=${BUILD_DIR:-$root/build}
jobs=${JOBS:-$(nproc)}
max_mib=${MAX_MIB:-60}

# The binaries, as paths under the build folder.
binaries=(
  kernels/kernels_cuda_test
  kernels/kvcache_gpu_bench
  tests/device_client_test
  tests/store_test
  service/kvcache-node
  tools/kvcache-demo
  tools/kvcache-soak
  client/examples/kvcache-prefill_worker
  client/examples/kvcache-decode_worker
  bench/kvcache-bench
)
targets=()
for b in "${binaries[@]}"; do targets+=("$(basename "$b")"); done

nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x $nvcc ]] || { echo "gpu-bundle: no nvcc ($nvcc)" >&2; exit 2; }
echo "== configure $build (CUDA on, sm_90)"
# An existing build keeps its compiler (naming another would rebuild all).
args=(-DKVCACHE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
[[ -f $build/CMakeCache.txt ]] || args+=(-G Ninja -DCMAKE_CUDA_COMPILER="$nvcc")
cmake -S "$root" -B "$build" "${args[@]}" >/dev/null
grep -q '^KVCACHE_BUILD_BENCH:BOOL=OFF' "$build/CMakeCache.txt" &&
  { echo "gpu-bundle: $build has KVCACHE_BUILD_BENCH=OFF" >&2; exit 2; }
echo "== build ${targets[*]}"
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib/ucx"
for b in "${binaries[@]}"; do
  strip -o "$out/bin/$(basename "$b")" "$build/$b"
done
# UCX loads its transports from lib/ucx beside libucs (found with dladdr).
# Only the shared-memory module travels: the GPU machine has no RDMA device
# to use, and ib/rdmacm would drag in the verbs libraries.
ucx_modules=$(dirname "$(ldconfig -p | awk '/libucs.so.0 /{print $NF; exit}')")/ucx
cp -L "$ucx_modules/libuct_cma.so.0" "$out/lib/ucx/"

# The closure: every library these link, except what every Linux with a
# driver already has. libstdc++ and libgcc_s are newer there (the GPU image
# is Ubuntu 24.04) and must match the system's glibc, so they stay too.
is_system() {
  case $(basename "$1") in
    ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libresolv.so*) return 0 ;;
    libstdc++.so*|libgcc_s.so*|libcuda.so*|libnvidia*|linux-vdso*) return 0 ;;
  esac
  return 1
}
for f in "$out"/bin/* "$out"/lib/ucx/*; do
  ldd "$f" | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  is_system "$lib" && continue
  name=$(basename "$lib")
  [[ -e $out/lib/$name ]] || strip -o "$out/lib/$name" "$(readlink -f "$lib")"
done
cp "$root/scripts/gpu-check.sh" "$out/gpu-check.sh"
chmod +x "$out/gpu-check.sh"

# What it needs of the machine: the newest glibc and libstdc++ symbols.
glibc=$(objdump -T "$out"/bin/* "$out"/lib/*.so* "$out"/lib/ucx/* 2>/dev/null |
  grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -1)
glibcxx=$(objdump -T "$out"/bin/* "$out"/lib/*.so* 2>/dev/null |
  grep -o 'GLIBCXX_3\.4\.[0-9]*' | sort -t. -k3 -n -u | tail -1)
mib=$(du -sm "$out" | cut -f1)
{
  echo "kvcache GPU bundle, $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet 2>/dev/null || echo '+changes')"
  echo "built $(date -u +%FT%TZ) on $(sed -n 's/^PRETTY_NAME="\(.*\)"/\1/p' /etc/os-release), $("$nvcc" --version | tail -1)"
  echo "$(find "$out/bin" -type f | wc -l) binaries, $(find "$out/lib" -maxdepth 1 -name '*.so*' | wc -l) libraries + $(find "$out/lib/ucx" -type f | wc -l) UCX module(s), ${mib} MiB"
  echo "needs glibc with $glibc and libstdc++ with $glibcxx"
} >"$out/BUNDLE"
cat "$out/BUNDLE"
if ((mib > max_mib)); then
  echo "gpu-bundle: ${mib} MiB is over ${max_mib} MiB" >&2
  exit 1
fi
