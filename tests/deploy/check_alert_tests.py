#!/usr/bin/env python3
"""Checks that every alert is documented and unit tested.

For each alert in deploy/prometheus/rules/*.yml:
  * it has a severity label and summary, description and runbook annotations;
  * its runbook points at a heading of docs/operations.md that exists;
  * some deploy/prometheus/tests/*.yml expects it to fire (a non-empty
    exp_alerts), so that `promtool test rules` exercises it.
Exit status 0 when all hold, 1 otherwise.
"""
import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def github_anchor(heading):
    a = heading.strip().lower()
    a = re.sub(r"[^\w\- ]", "", a)
    return a.replace(" ", "-")


def main():
    alerts = {}
    for f in sorted((ROOT / "deploy/prometheus/rules").glob("*.yml")):
        for g in yaml.safe_load(f.read_text())["groups"]:
            for r in g["rules"]:
                if "alert" in r:
                    alerts[r["alert"]] = r
    fired = set()
    for f in sorted((ROOT / "deploy/prometheus/tests").glob("*.yml")):
        for t in yaml.safe_load(f.read_text()).get("tests", []):
            for a in t.get("alert_rule_test", []):
                if a.get("exp_alerts"):
                    fired.add(a["alertname"])
    doc = ROOT / "docs/operations.md"
    anchors = set()
    if doc.exists():
        anchors = {github_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", doc.read_text(), re.M)}
    errors = []
    for name, r in alerts.items():
        if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
            errors.append(f"{name}: severity label must be critical, warning or info")
        ann = r.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            if not ann.get(key):
                errors.append(f"{name}: no {key} annotation")
        runbook = ann.get("runbook", "")
        m = re.fullmatch(r"docs/operations\.md#([\w-]+)", runbook)
        if not m:
            errors.append(f"{name}: runbook {runbook!r} is not docs/operations.md#<anchor>")
        elif m.group(1) not in anchors:
            errors.append(f"{name}: docs/operations.md has no heading for #{m.group(1)}")
        if name not in fired:
            errors.append(f"{name}: no unit test in deploy/prometheus/tests expects it to fire")
    for e in errors:
        print(f"FAIL {e}")
    print(f"{'FAIL' if errors else 'ok'}: {len(alerts)} alerts, {len(fired & set(alerts))} with firing unit tests")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
