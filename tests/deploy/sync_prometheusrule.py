#!/usr/bin/env python3
"""Keeps the PrometheusRule in step with the plain Prometheus rules file.

Source of truth: deploy/prometheus/rules/kvcache-alerts.yml (checked and unit
tested with promtool). This writes its groups into
deploy/k8s/components/monitoring/prometheusrule.yaml.

    python3 tests/deploy/sync_prometheusrule.py          # regenerate
    python3 tests/deploy/sync_prometheusrule.py --check  # fail if they differ
"""
import argparse
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/rules/kvcache-alerts.yml"
OUT = ROOT / "deploy/k8s/components/monitoring/prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/rules/kvcache-alerts.yml by
# tests/deploy/sync_prometheusrule.py. Do not edit: edit the rules file, then
# run `python3 tests/deploy/sync_prometheusrule.py`.
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value):
    # Multi-line expressions stay readable as literal blocks.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render():
    rules = yaml.safe_load(RULES.read_text())
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "kvcache",
            "labels": {"app.kubernetes.io/name": "kvcache", "app.kubernetes.io/component": "cache-node"},
        },
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000, default_flow_style=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = render()
    rel = OUT.relative_to(ROOT)
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"FAIL {rel} differs from {RULES.relative_to(ROOT)}: "
                  "run python3 tests/deploy/sync_prometheusrule.py", file=sys.stderr)
            return 1
        # Belt and braces: the rule groups must be equal as data too.
        ours = yaml.safe_load(OUT.read_text())["spec"]["groups"]
        if ours != yaml.safe_load(RULES.read_text())["groups"]:
            print(f"FAIL {rel}: groups differ from the rules file", file=sys.stderr)
            return 1
        print(f"ok {rel} matches {RULES.relative_to(ROOT)}")
        return 0
    OUT.write_text(text)
    print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
