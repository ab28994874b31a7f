#!/usr/bin/env python3
"""Integration test of the local observability run (scripts/observe.sh --test).

Against a real Prometheus scraping real kvcache nodes, through Prometheus's
HTTP API (/api/v1/query, /api/v1/query_range):
  1. every node is an up target of job="kvcache" and reports ready;
  2. kvcache_pool_capacity_bytes exists (> 0) for every node;
  3. the load command runs and exits 0;
  4. kvcache_pool_used_bytes increases on every node (--any-node: in total);
  5. kvcache_token_capacity_remaining exists for every node and moves down
     while the load writes.

    python3 tests/deploy/observe_test.py --prometheus http://127.0.0.1:19090 \\
        --targets 127.0.0.1:17702,127.0.0.1:17712 --load-cmd 'build/tools/kvcache-demo ...'

--targets are the nodes' metrics addresses, i.e. their `instance` labels.
Prints one line per check and 'observe: N passed, M failed'; exit status 0
when all pass.
"""
import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request


class Prom:
    def __init__(self, url):
        self.url = url.rstrip("/")

    def _get(self, path, **params):
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def ready(self):
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, expr):
        """Instant query -> [(labels, float)]."""
        data = self._get("/api/v1/query", query=expr)
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def query_range(self, expr, start, end, step=1):
        """Range query -> [(labels, [float])]."""
        data = self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)
        return [(s["metric"], [float(v) for _, v in s["values"]]) for s in data["result"]]


def by_instance(samples):
    out = {}
    for labels, value in samples:
        out.setdefault(labels.get("instance"), []).append((labels, value))
    return out


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def record(self, name, ok, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        return ok


def wait_for(predicate, timeout, interval=1.0):
    deadline = time.time() + timeout
    while True:
        result = predicate()
        if result or time.time() >= deadline:
            return result
        time.sleep(interval)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:19090")
    ap.add_argument("--targets", required=True, help="comma-separated metrics host:port of every node")
    ap.add_argument("--job", default="kvcache")
    ap.add_argument("--load-cmd", default="", help="bash command that writes to the nodes")
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--timeout", type=float, default=30, help="seconds to wait for scrapes to show a change")
    ap.add_argument("--any-node", action="store_true",
                    help="require the used bytes to grow in total only, not on every node")
    args = ap.parse_args()
    prom = Prom(args.prometheus)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    sel = f'job="{args.job}"'
    c = Checks()

    if not c.record("prometheus ready", wait_for(prom.ready, args.timeout), args.prometheus):
        return finish(c)

    def up_all():
        got = by_instance(prom.query(f"up{{{sel}}} == 1"))
        return all(t in got for t in targets) and got
    up = wait_for(up_all, args.timeout) or by_instance(prom.query(f"up{{{sel}}}"))
    missing = [t for t in targets if t not in up]
    c.record("every node is an up scrape target", not missing, f"not up: {missing}" if missing else
             f"{len(targets)} nodes")

    ready = by_instance(prom.query(f"kvcache_ready{{{sel}}}"))
    bad = [t for t in targets if not ready.get(t) or ready[t][0][1] != 1]
    c.record("every node reports kvcache_ready 1", not bad, f"not ready: {bad}" if bad else "")

    cap = by_instance(prom.query(f"kvcache_pool_capacity_bytes{{{sel}}}"))
    bad = [t for t in targets if not cap.get(t) or cap[t][0][1] <= 0]
    c.record("kvcache_pool_capacity_bytes > 0 for every node", not bad,
             f"missing or zero: {bad}" if bad else
             ", ".join(f"{t}={int(cap[t][0][1])}" for t in targets))

    def used_now():
        return {t: v[0][1] for t, v in by_instance(prom.query(f"kvcache_pool_used_bytes{{{sel}}}")).items()}
    before = used_now()
    c.record("kvcache_pool_used_bytes exists for every node", all(t in before for t in targets),
             f"before the load: {before}")

    if not args.load_cmd:
        c.record("load command given", False, "pass --load-cmd (scripts/observe.sh --test does)")
        return finish(c)
    start = time.time()
    print(f"---- load: {args.load_cmd}", flush=True)
    try:
        rc = subprocess.run(["bash", "-c", args.load_cmd], timeout=args.load_timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"---- load finished in {time.time() - start:.1f}s", flush=True)
    c.record("load command exits 0", rc == 0, f"exit status {rc}")

    def grown():
        now = used_now()
        grew = [t for t in targets if now.get(t, 0) > before.get(t, 0)]
        total = sum(now.get(t, 0) for t in targets) > sum(before.get(t, 0) for t in targets)
        ok = total if args.any_node else len(grew) == len(targets)
        return (now, grew) if ok else None
    res = wait_for(grown, args.timeout)
    now = res[0] if res else used_now()
    grew = [t for t in targets if now.get(t, 0) > before.get(t, 0)]
    c.record("kvcache_pool_used_bytes increased " + ("in total" if args.any_node else "on every node"),
             bool(res), ", ".join(f"{t}: {int(before.get(t, 0))} -> {int(now.get(t, 0))}" for t in targets))

    # Let one more scrape land, then look at the load window.
    time.sleep(2)
    end = time.time()
    tokens = by_instance(prom.query(f"kvcache_token_capacity_remaining{{{sel}}}"))
    missing = [t for t in targets if t not in tokens]
    c.record("kvcache_token_capacity_remaining exists for every node", not missing,
             f"missing: {missing}" if missing else
             ", ".join(f"{t}: {len(tokens[t])} series" for t in targets))
    window = by_instance((l, v) for l, v in
                         prom.query_range(f"kvcache_token_capacity_remaining{{{sel}}}", start - 2, end))
    moved, detail = [], []
    for t in targets:
        series = window.get(t, [])
        # Moved down: some series' last value is below the highest it had in the window.
        if any(vals and vals[-1] < max(vals) for _, vals in series):
            moved.append(t)
        detail.append(f"{t}: " + "; ".join(
            f"{l.get('kv_namespace')}/{l.get('codec')} {int(max(v))} -> {int(v[-1])}" for l, v in series if v))
    need = 1 if args.any_node else len(targets)
    c.record("kvcache_token_capacity_remaining went down during the load", len(moved) >= need and not missing,
             " | ".join(detail) or "no samples in the load window")
    return finish(c)


def finish(c):
    print(f"observe: {c.passed} passed, {c.failed} failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
