#!/usr/bin/env bash
# Proves the GPU bundle runs on a machine with none of our packages: builds
# it (scripts/gpu-bundle.sh), then, in a private mount namespace, runs every
# bundled binary under chroot in a root that holds only glibc, libstdc++ and
# libgcc_s (and /dev, /proc, /sys, /tmp), and then the bundle's
# gpu-check.sh with every binary so confined. Without a GPU every GPU step
# must say "no device" and every host step must pass. Needs root (chroot,
# mounts); CI runs it from scripts/test.sh.
#
#   scripts/gpu-bundle-check.sh [BUNDLE_DIR]   # default: build a fresh one
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [[ $# -ge 1 ]]; then
  bundle=$(cd "$1" && pwd)
else
  bundle=$root/gpu-bundle
  "$root/scripts/gpu-bundle.sh" "$bundle"
fi
if [[ $(id -u) != 0 ]]; then
  echo "gpu-bundle-check: needs root (chroot and mounts)" >&2
  exit 2
fi
rootfs=$(mktemp -d)
work=$(mktemp -d)
trap 'rm -rf "$rootfs" "$work"' EXIT

# The isolated root: the dynamic loader, glibc's libraries, libstdc++ and
# libgcc_s, at the paths the loader searches by default.
libdir=/lib/x86_64-linux-gnu
mkdir -p "$rootfs/lib64" "$rootfs$libdir" "$rootfs/tmp" "$rootfs/dev" \
  "$rootfs/proc" "$rootfs/sys" "$rootfs$bundle"
cp -L /lib64/ld-linux-x86-64.so.2 "$rootfs/lib64/"
for lib in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 \
  libresolv.so.2 libstdc++.so.6 libgcc_s.so.1; do
  cp -L "$libdir/$lib" "$rootfs$libdir/"
done
chmod 1777 "$rootfs/tmp"
echo "isolated root: $(cd "$rootfs" && find . -type f | sort | tr '\n' ' ')"

cat >"$work/inside.sh" <<EOF
set -euo pipefail
mount --bind /dev "$rootfs/dev"
mount -t tmpfs tmpfs "$rootfs/dev/shm"
mount -t proc proc "$rootfs/proc"
mount --bind /sys "$rootfs/sys"
mount --bind "$bundle" "$rootfs$bundle"
export LD_LIBRARY_PATH="$bundle/lib"
bad=0
for bin in "$bundle"/bin/*; do
  case \$(basename "\$bin") in
    *_test) args=(--gtest_list_tests) ;;
    *) args=(--help) ;;
  esac
  out=\$(chroot "$rootfs" "\$bin" "\${args[@]}" 2>&1) && rc=0 || rc=\$?
  if ((rc == 127)) || grep -q 'error while loading shared libraries' <<<"\$out"; then
    echo "\$(basename "\$bin"): does not load: \$(head -1 <<<"\$out")"
    bad=1
  else
    echo "\$(basename "\$bin"): loads (exit \$rc)"
  fi
done
((bad == 0)) || exit 1
cd "$work"
KVCACHE_EXEC="chroot $rootfs" GPU_CHECK_LOGS="$work/logs" "$bundle/gpu-check.sh"
EOF
unshare -m --propagation private bash "$work/inside.sh"
report=$work/gpu-check.txt
# Without a device: no step may pass or fail as a GPU step, the host ones pass.
if grep -E '^\| (node-gpu|soak|throughput|kernels|memcheck|codecs|store) ' "$report" |
  grep -qv 'no device'; then
  echo "gpu-bundle-check: a GPU step did not report 'no device' here" >&2
  exit 1
fi
grep -qE '^\| node-host +\| PASS' "$report" || { echo "gpu-bundle-check: the host node did not pass" >&2; exit 1; }
grep -qE '^\| device +\| PASS' "$report" || { echo "gpu-bundle-check: the device client's host tests did not pass" >&2; exit 1; }
echo "gpu-bundle-check: the bundle runs in an isolated root; GPU steps report no device, host steps pass"
