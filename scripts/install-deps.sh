#!/usr/bin/env bash
# Installs, with apt, whatever the build, the tests and the demo need and is
# missing. Idempotent: a machine that has everything is left untouched.
# Debian 12 (bookworm); run as root (or with sudo available).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git curl ca-certificates clang-14
  libfuzzer-14-dev
  python3 python3-venv python3-pip
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libucx-dev ucx-utils prometheus-cpp-dev libhwy-dev
  libxxhash-dev libgtest-dev libgmock-dev libbenchmark-dev
  prometheus kubectl openssl
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    # kubectl is not a Debian 12 package: accept one already on PATH.
    if [[ $p == kubectl ]] && command -v kubectl >/dev/null; then continue; fi
    missing+=("$p")
  fi
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: everything is installed"
  exit 0
fi

sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
installable=()
for p in "${missing[@]}"; do
  if apt-cache show "$p" >/dev/null 2>&1; then
    installable+=("$p")
  else
    echo "install-deps: note: package $p is not available from apt here; skipping"
  fi
done
if ((${#installable[@]} > 0)); then
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${installable[@]}"
fi
