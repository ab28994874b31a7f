#!/usr/bin/env bash
# kvcache-bench still runs end to end, briefly, over tcp on loopback: both
# operations, ucx_perftest beside them, and the output the docs and the
# issue rely on (the cpu-s/GiB columns; last line `ratio get=X put=Y` with
# both ratios above zero). Not a performance check: no figure is judged.
# Usage: bench_smoke_test.sh BIN_DIR
set -euo pipefail
bin_dir=$1
# stdout is what the docs quote; the in-process node logs to stderr.
out=$(mktemp)
err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
fail() {
  echo "bench_smoke_test: $*"
  cat "$out" "$err"
  exit 1
}
UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 300 "$bin_dir/bench/kvcache-bench" \
  --sizes=256KiB --streams=2 --seconds=0.3 --runs=1 --memory=128MiB \
  --no-warmup >"$out" 2>"$err" || fail "kvcache-bench failed"
grep -q 'cpu-s/GiB' "$out" || fail "no cpu-s/GiB column"
for op in get put pt-put pt-am; do
  grep -qE "^$op +256KiB " "$out" || fail "no $op row"
done
last=$(tail -n 1 "$out")
[[ $last =~ ^ratio\ get=([0-9]+\.[0-9]+)\ put=([0-9]+\.[0-9]+)$ ]] ||
  fail "last line is not 'ratio get=X put=Y': $last"
for r in "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"; do
  [[ $r != 0.00 ]] || fail "a ratio is zero: $last"
done
# Whole-block reads (--read=blocks) run as well.
UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 300 "$bin_dir/bench/kvcache-bench" \
  --sizes=256KiB --streams=2 --seconds=0.3 --runs=1 --memory=128MiB \
  --no-warmup --no-perftest --ops=get --read=blocks >"$out" 2>"$err" ||
  fail "kvcache-bench --read=blocks failed"
grep -qE "^get +256KiB " "$out" || fail "no get row with --read=blocks"
echo "bench_smoke_test: ok ($last)"
