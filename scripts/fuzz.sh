#!/usr/bin/env bash
# The libFuzzer targets of fuzz/ (docs/operations.md, "Fuzzing"): configures
# and builds a clang tree with -DKVCACHE_FUZZ=ON (build-fuzz: ASan + UBSan),
# runs every input of fuzz/regressions/<target>/ once, then fuzzes each
# target for KVCACHE_FUZZ_SECONDS (default 30) on a temporary copy of its
# seed corpus (fuzz/corpus/<target>/), so that nothing is written into the
# repository. Exits non-zero when a target crashes, leaks or aborts on a
# check; the input that did is kept under $KVCACHE_FUZZ_ARTIFACTS (default
# a temporary directory, printed).
#
# Usage: scripts/fuzz.sh [TARGET...]   (default: every target)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KVCACHE_FUZZ_BUILD:-$root/build-fuzz}
seconds=${KVCACHE_FUZZ_SECONDS:-30}
jobs=${KVCACHE_FUZZ_JOBS:-$(nproc)}
all_targets=(fuzz_wire fuzz_block_header fuzz_npy fuzz_codec_decode fuzz_rpc)
targets=("$@")
if ((${#targets[@]} == 0)); then targets=("${all_targets[@]}"); fi

CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCACHE_FUZZ=ON -DKVCACHE_CUDA=OFF \
  -DKVCACHE_BUILD_BENCH=OFF -DKVCACHE_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
artifacts=${KVCACHE_FUZZ_ARTIFACTS:-$(mktemp -d)}
mkdir -p "$artifacts"
keep_artifacts=${KVCACHE_FUZZ_ARTIFACTS:+1}
# Every sanitizer finding is fatal; gRPC's and UCX's uninstrumented frames
# are suppressed as in the ASan suite (tests/sanitizers/lsan.supp).
export ASAN_OPTIONS="abort_on_error=1:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

failed=()
for t in "${targets[@]}"; do
  bin=$build/fuzz/$t
  regressions=$root/fuzz/regressions/$t
  if [[ -d $regressions ]] && compgen -G "$regressions/*" >/dev/null; then
    echo "== $t: the regression inputs of fuzz/regressions/$t"
    if ! "$bin" -runs=1 "$regressions"/* >"$work/$t.regressions.log" 2>&1; then
      tail -n 40 "$work/$t.regressions.log"
      failed+=("$t (a regression input)")
      continue
    fi
  fi
  echo "== $t: fuzzing for $seconds s"
  corpus=$work/corpus/$t
  mkdir -p "$corpus" "$artifacts/$t"
  cp "$root/fuzz/corpus/$t"/* "$corpus"/
  start=$(date +%s)
  if "$bin" -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix="$artifacts/$t/" "$corpus" >"$work/$t.log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/$t.log")
    echo "   ok: $runs runs, $rate exec/s, $(( $(date +%s) - start )) s"
  else
    tail -n 60 "$work/$t.log"
    echo "   the input is under $artifacts/$t/"
    failed+=("$t")
  fi
done

if ((${#failed[@]} > 0)); then
  echo "fuzz: FAILED: ${failed[*]} (to keep a crash: copy it to"
  echo "fuzz/regressions/<target>/, see docs/operations.md)"
  exit 1
fi
if [[ -z $keep_artifacts ]]; then rm -rf "$artifacts"; fi
echo "fuzz: every target ran clean"
