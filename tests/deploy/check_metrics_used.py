#!/usr/bin/env python3
"""Checks that every metric the dashboard and the alerts query is exported.

    python3 tests/deploy/check_metrics_used.py deploy/testdata/metrics-sample.txt
    python3 tests/deploy/check_metrics_used.py http://127.0.0.1:17702/metrics

The argument is a Prometheus text exposition: a file (e.g. saved from a
running node with `curl -s http://HOST:PORT/metrics`) or an http(s) URL.

Checked, for every PromQL expression in deploy/grafana/*.json (panel targets
and template variables) and deploy/prometheus/rules/*.yml:
  * each metric name is exported (histogram series names _bucket/_sum/_count
    included), or is one Prometheus makes itself (up, scrape_*, ALERTS) or a
    recording rule of the rules files;
  * each label name used in a matcher ({label="..."}) exists on that metric
    in the exposition, or is a target label Prometheus adds (job, instance,
    ...). Skipped, with a note, for a metric that has no samples yet.
With --promtool, the dashboard expressions are also parsed by
`promtool check rules` (Grafana variables replaced by plausible values).
Exported kvcache_ metrics used nowhere are listed (informational).
Exit status 0 when all checks pass, 1 otherwise.
"""
import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import urllib.request

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMETHEUS_MADE = {"up", "ALERTS", "ALERTS_FOR_STATE"}
PROMETHEUS_MADE_PREFIXES = ("scrape_",)
# Labels Prometheus attaches to every scraped series (static config and the
# PodMonitor in deploy/k8s/components/monitoring).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint"}

KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan", "atan2", "start", "end",
    # aggregation operators (may be followed by `by (...)` instead of `(`)
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}
GRAFANA_DURATIONS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                     "${__rate_interval}": "5m", "${__interval}": "1m", "${__range}": "1h"}
IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"


# ---------------------------------------------------------------------------
# Exposition


def parse_exposition(text):
    """Returns ({series name: set(label names)}, {family name: type})."""
    series, types = {}, {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            m = re.match(rf"#\s+TYPE\s+({IDENT})\s+(\w+)", line)
            if m:
                types[m.group(1)] = m.group(2)
            continue
        m = re.match(rf"({IDENT})\s*(\{{.*\}})?\s", line + " ")
        if not m:
            raise ValueError(f"not an exposition line: {line!r}")
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"', m.group(2) or ""))
        series.setdefault(m.group(1), set()).update(labels)
    return series, types


def known_names(series, types):
    names = set(series)
    for fam, typ in types.items():
        names.add(fam)
        if typ in ("histogram", "gaugehistogram"):
            names.update({fam + "_bucket", fam + "_sum", fam + "_count"})
        elif typ == "summary":
            names.update({fam + "_sum", fam + "_count"})
        elif typ == "counter" and not fam.endswith("_total"):
            names.add(fam + "_total")  # OpenMetrics names counter families without _total
    return names


# ---------------------------------------------------------------------------
# PromQL


def grafana_to_promql(expr):
    for var, value in GRAFANA_DURATIONS.items():
        expr = expr.replace(var, value)
    # Remaining variables ($job, ${instance}, ${instance:regex}) only appear
    # inside label-matcher strings in our dashboards.
    return re.sub(r"\$\{[^}]*\}|\$[a-zA-Z_]\w*", "x", expr)


def references(expr):
    """Returns [(metric, {label names in its matchers})] used by a PromQL expression."""
    expr = grafana_to_promql(expr)
    # Strings first, so that nothing inside them is taken for a name.
    no_str = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    refs = []
    # metric{matchers}
    for m in re.finditer(rf"({IDENT})?\s*\{{([^}}]*)\}}", no_str):
        labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2)))
        name = m.group(1)
        if name and name not in KEYWORDS:
            refs.append((name, labels))
    bare = re.sub(r"\{[^}]*\}", " ", no_str)
    bare = re.sub(r"\[[^\]]*\]", " ", bare)  # ranges and subqueries
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    for m in re.finditer(rf"(?<![\w.:]){IDENT}", bare):
        name = m.group(0)
        rest = bare[m.end():].lstrip()
        if name in KEYWORDS or rest.startswith("("):  # functions and aggregations
            continue
        if re.fullmatch(r"\d", name[0]):
            continue
        if not any(r[0] == name for r in refs):
            refs.append((name, set()))
    return refs


def template_queries(var):
    q = var.get("query")
    if isinstance(q, dict):
        q = q.get("query")
    if not isinstance(q, str) or var.get("type") != "query":
        return []
    m = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_]\w*)\s*\)\s*", q, re.S)
    if m:
        return [m.group(1)]
    m = re.fullmatch(r"\s*(?:query_result|label_values)\((.*)\)\s*", q, re.S)
    return [m.group(1)] if m else [q]


def dashboard_exprs(path):
    d = json.loads(path.read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"{path.name}: panel {p.get('title')!r} {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))

    walk(d.get("panels", []))
    for var in d.get("templating", {}).get("list", []):
        for q in template_queries(var):
            out.append((f"{path.name}: variable {var.get('name')!r}", q))
    return out


def rule_exprs(path):
    doc = yaml.safe_load(path.read_text())
    out, records = [], set()
    for g in doc.get("groups", []):
        for r in g.get("rules", []):
            name = r.get("alert") or r.get("record")
            out.append((f"{path.name}: {name}", str(r["expr"])))
            if r.get("record"):
                records.add(r["record"])
    return out, records


def promtool_parse(exprs):
    """Runs the expressions through promtool as recording rules; returns errors."""
    rules = [{"record": f"kvcache:check_{i}", "expr": grafana_to_promql(e)} for i, (_, e) in enumerate(exprs)]
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump({"groups": [{"name": "dashboard-exprs", "rules": rules}]}, f)
    r = subprocess.run(["promtool", "check", "rules", f.name], capture_output=True, text=True)
    pathlib.Path(f.name).unlink()
    if r.returncode == 0:
        return []
    return [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]


def load_exposition(src):
    if re.match(r"https?://", src):
        with urllib.request.urlopen(src, timeout=10) as resp:
            return resp.read().decode()
    return pathlib.Path(src).read_text()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="?", default=str(ROOT / "deploy/testdata/metrics-sample.txt"),
                    help="exposition text file or URL (default: deploy/testdata/metrics-sample.txt)")
    ap.add_argument("--dashboard", action="append", type=pathlib.Path,
                    help="default: deploy/grafana/*.json")
    ap.add_argument("--rules", action="append", type=pathlib.Path,
                    help="default: deploy/prometheus/rules/*.yml")
    ap.add_argument("--promtool", action="store_true", help="also parse dashboard expressions with promtool")
    args = ap.parse_args()
    dashboards = args.dashboard or sorted((ROOT / "deploy/grafana").glob("*.json"))
    rule_files = args.rules or sorted((ROOT / "deploy/prometheus/rules").glob("*.yml"))

    series, types = parse_exposition(load_exposition(args.metrics))
    exported = known_names(series, types)
    exprs, records = [], set()
    for r in rule_files:
        e, rec = rule_exprs(r)
        exprs += e
        records |= rec
    dash = []
    for d in dashboards:
        dash += dashboard_exprs(d)
    exprs += dash

    errors, notes, used = [], set(), set()
    for where, expr in exprs:
        for name, labels in references(expr):
            used.add(name)
            if name in PROMETHEUS_MADE or name.startswith(PROMETHEUS_MADE_PREFIXES) or name in records:
                continue
            if name not in exported:
                errors.append(f"{where}: metric {name} is not exported")
                continue
            if name not in series:
                notes.add(f"{name} has no samples in the exposition: its labels were not checked")
                continue
            for label in sorted(labels - series[name] - TARGET_LABELS - {"__name__"}):
                errors.append(f"{where}: metric {name} has no label {label!r} "
                              f"(it has {sorted(series[name]) or 'none'})")
    if args.promtool and dash:
        errors += [f"promtool (dashboard expressions): {line}" for line in promtool_parse(dash)]

    fams = {f for f in types if f.startswith("kvcache_")}
    unused = sorted(f for f in fams if not any(u == f or u.startswith(f + "_") for u in used))
    for n in sorted(notes):
        print(f"note: {n}")
    if unused:
        print(f"note: exported but not used by the dashboard or alerts: {', '.join(unused)}")
    for e in errors:
        print(f"FAIL {e}")
    print(f"{'FAIL' if errors else 'ok'}: {len(exprs)} expressions ({len(dash)} dashboard, "
          f"{len(exprs) - len(dash)} rules), {len(used)} metric names, against {args.metrics}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
