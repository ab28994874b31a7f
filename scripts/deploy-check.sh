#!/usr/bin/env bash
# Offline checks of the deployment artifacts (issue 7):
#   1. kubectl kustomize of the base and of every overlay;
#   2. strict schema validation of the output, Prometheus Operator kinds
#      included, plus kvcache policy checks (tests/deploy/validate_manifests.py);
#   3. the PrometheusRule is in step with the plain rules file;
#   4. promtool check rules / check config, promtool test rules, and every
#      alert has a firing unit test and a runbook section in docs/operations.md;
#   5. the Grafana dashboard JSON is what its generator writes;
#   6. every metric the dashboard and the alerts query is exported, in a
#      /metrics exposition (tests/deploy/check_metrics_used.py); the
#      dashboard's PromQL parses; the exposition passes promtool check metrics;
#   7. the image: static Dockerfile checks (no Docker engine needed) and the
#      entrypoint's --memory sizing; shellcheck of the scripts (when
#      installed);
#   8. the observability harness (scripts/observe.sh --test with stand-in
#      nodes and a real Prometheus); skip with KVCACHE_DEPLOY_SKIP_OBSERVE=1.
#
# Usage: scripts/deploy-check.sh [METRICS]
#   METRICS: a /metrics text file or URL of a running node
#            (default $KVCACHE_METRICS, else deploy/testdata/metrics-sample.txt)
# Env: KVCACHE_DEPLOY_NO_INSTALL=1 never installs anything (fails instead).
# Exit status: 0 when every check passes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

METRICS=${1:-${KVCACHE_METRICS:-deploy/testdata/metrics-sample.txt}}
PY=${PYTHON:-python3}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/kvcache-deploy-check.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
passed=0
failed=0
failures=()

# -- prerequisites (installed only when missing) ------------------------------
need_install=${KVCACHE_DEPLOY_NO_INSTALL:-0}
if ! command -v promtool >/dev/null; then
  if [[ $need_install != 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "deploy-check: installing Debian's prometheus package (promtool)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } >"$OUT/apt.log" 2>&1 \
      || { cat "$OUT/apt.log"; echo "deploy-check: could not install prometheus" >&2; exit 2; }
  else
    echo "deploy-check: promtool not found (apt-get install prometheus)" >&2
    exit 2
  fi
fi
if ! command -v kubectl >/dev/null; then
  echo "deploy-check: kubectl not found (it provides 'kubectl kustomize')" >&2
  exit 2
fi
if ! "$PY" -c 'import kubernetes_validate, cloudcoil.models.prometheus_operator, jsonschema, yaml' 2>/dev/null; then
  if [[ $need_install == 1 ]]; then
    echo "deploy-check: python packages missing: $PY -m pip install -r deploy/requirements.txt" >&2
    exit 2
  fi
  echo "deploy-check: installing deploy/requirements.txt"
  "$PY" -m pip install -q --disable-pip-version-check -r deploy/requirements.txt >"$OUT/pip.log" 2>&1 \
    || { cat "$OUT/pip.log"; echo "deploy-check: pip install failed" >&2; exit 2; }
fi

# -- helpers ------------------------------------------------------------------
check() { # check NAME COMMAND...: runs one check, output indented
  local name=$1
  shift
  echo "=== $name"
  if "$@" > "$OUT/step.log" 2>&1; then
    sed 's/^/    /' "$OUT/step.log"
    echo "    PASS $name"
    passed=$((passed + 1))
  else
    sed 's/^/    /' "$OUT/step.log"
    echo "    FAIL $name"
    failed=$((failed + 1))
    failures+=("$name")
  fi
}

render() { # render DIR NAME
  kubectl kustomize "$1" > "$OUT/$2.yaml" && echo "$(grep -c '^kind:' "$OUT/$2.yaml") objects from $1"
}

# -- 1 + 2: kustomize and validate ---------------------------------------------
check "kustomize base" render deploy/k8s/base base
check "validate base" "$PY" tests/deploy/validate_manifests.py --overlay base "$OUT/base.yaml"
for dir in deploy/k8s/overlays/*/; do
  dir=${dir%/}
  overlay=$(basename "$dir")
  check "kustomize $overlay" render "$dir" "$overlay"
  check "validate $overlay" "$PY" tests/deploy/validate_manifests.py --overlay "$overlay" "$OUT/$overlay.yaml"
done
check "data-plane rules fail their mutations" "$PY" tests/deploy/check_data_plane_rules.py "$OUT/trusted-tcp.yaml"

# -- 3 + 4: alert rules ---------------------------------------------------------
check "PrometheusRule in sync with rules file" "$PY" tests/deploy/sync_prometheusrule.py --check
check "promtool check rules" promtool check rules deploy/prometheus/rules/*.yml
check "promtool check config" promtool check config deploy/prometheus/prometheus.yml
check "promtool test rules" promtool test rules deploy/prometheus/tests/*.yml
check "every alert documented and tested" "$PY" tests/deploy/check_alert_tests.py

# -- 5: dashboard -------------------------------------------------------------
check "dashboard JSON up to date" "$PY" deploy/grafana/generate_dashboard.py --check

# -- 6: metrics used vs exported -----------------------------------------------
fetch_metrics() {
  if [[ $METRICS =~ ^https?:// ]]; then
    curl -fsS --max-time 10 "$METRICS" > "$OUT/metrics.txt"
  else
    cp "$METRICS" "$OUT/metrics.txt"
  fi
}
check "read exposition $METRICS" fetch_metrics
if [[ -s $OUT/metrics.txt ]]; then
  check "promtool check metrics" sh -c "promtool check metrics < '$OUT/metrics.txt'"
  check "metrics used are exported" "$PY" tests/deploy/check_metrics_used.py --promtool "$METRICS"
fi

# -- 7: image and scripts -----------------------------------------------------
check "Dockerfile static checks" "$PY" tests/deploy/check_dockerfile.py
check "entrypoint sizes --memory" tests/deploy/entrypoint_test.sh
if command -v shellcheck > /dev/null; then
  check "shellcheck" shellcheck scripts/deploy-check.sh scripts/observe.sh scripts/gpu-bundle.sh scripts/gpu-bundle-check.sh scripts/gpu-check.sh deploy/docker/*.sh tests/deploy/*.sh
else
  echo "=== shellcheck: not installed, skipped"
fi

# -- 8: observability harness ---------------------------------------------------
if [[ ${KVCACHE_DEPLOY_SKIP_OBSERVE:-0} != 1 ]]; then
  check "observe harness self-test" tests/deploy/observe_selftest.sh
fi

echo
if ((failed)); then
  printf 'deploy-check: failed: %s\n' "${failures[@]}"
fi
echo "deploy-check: $passed passed, $failed failed"
((failed == 0))
