#!/bin/sh
# runtime-deps.sh FILE...: run in the build stage of deploy/docker/Dockerfile.
# Prints, one per line as PACKAGE=VERSION, the Debian packages (from the
# Debian or the NVIDIA CUDA repository) that own the shared libraries FILE...
# load, so that the runtime stage installs exactly those. Libraries no package
# owns (e.g. UCX built into /opt/ucx, copied whole) are reported on stderr;
# libraries that are not found (the NVIDIA driver's libcuda, injected at run
# time by the NVIDIA container runtime) are skipped.
set -eu
for f in "$@"; do
  ldd "$f" 2> /dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
done | sort -u | while read -r lib; do
  real=$(readlink -f "$lib")
  owner=""
  # Debian 12 merges /lib into /usr/lib: dpkg may know either spelling.
  for p in "$lib" "$real" "/usr$lib" "/usr$real" "${lib#/usr}" "${real#/usr}"; do
    owner=$(dpkg-query -S "$p" 2> /dev/null | grep -v '^diversion' | head -n 1 | cut -d: -f1) || true
    [ -n "$owner" ] && break
  done
  if [ -n "$owner" ]; then
    dpkg-query -W -f='${Package}=${Version}\n' "$owner"
  else
    echo "runtime-deps: no package owns $lib" >&2
  fi
done | sort -u
