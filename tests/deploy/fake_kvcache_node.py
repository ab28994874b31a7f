#!/usr/bin/env python3
"""A stand-in for kvcache-node, to test the observability harness itself.

NOT the node: it only mimics what scripts/observe.sh and observe_test.py
touch, so that they can be exercised before (or without) the real binary:
  * the flags --listen, --health-listen, --metrics-listen, --memory=host:SIZE,
    --drain-timeout (others are ignored);
  * /metrics on --metrics-listen with the kvcache_ gauges the test queries;
  * a plain-HTTP "write" on --listen (POST /write?tokens=N), standing in for
    the gRPC data path; scripts/observe.sh's load hook is pointed at it by
    tests/deploy/observe_selftest.sh;
  * SIGTERM: kvcache_ready drops to 0, then it exits 0.
"""
import http.server
import re
import signal
import sys
import threading
import time
import urllib.parse

BYTES_PER_TOKEN = 4096
UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def flag(name, default=None):
    for a in sys.argv[1:]:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


def hostport(v):
    h, p = v.rsplit(":", 1)
    return h, int(p)


m = re.fullmatch(r"host:(\d+)(\w*)", flag("memory", "host:256MiB"))
CAPACITY = int(m.group(1)) * UNITS[m.group(2)]
state = {"used": 0, "ready": 1, "namespaces": set(), "writes": 0}
lock = threading.Lock()


def exposition():
    with lock:
        used, ready, nss = state["used"], state["ready"], sorted(state["namespaces"])
    lines = [
        "# TYPE kvcache_build_info gauge", 'kvcache_build_info{version="fake",cuda="none"} 1',
        "# TYPE kvcache_ready gauge", f"kvcache_ready {ready}",
        "# TYPE kvcache_pool_capacity_bytes gauge", f"kvcache_pool_capacity_bytes {CAPACITY}",
        "# TYPE kvcache_pool_used_bytes gauge", f"kvcache_pool_used_bytes {used}",
        "# TYPE kvcache_pool_used_ratio gauge", f"kvcache_pool_used_ratio {used / CAPACITY}",
        "# TYPE kvcache_token_capacity_remaining gauge",
    ]
    lines += [f'kvcache_token_capacity_remaining{{kv_namespace="{ns}",codec="fp8_e4m3"}} '
              f"{(CAPACITY - used) // BYTES_PER_TOKEN}" for ns in nss]
    return ("\n".join(lines) + "\n").encode()


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = exposition()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


class Data(Metrics):
    def do_POST(self):
        u = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(u.query)
        if u.path != "/write" or not state["ready"]:
            self.send_error(503 if u.path == "/write" else 404)
            return
        tokens = int(q.get("tokens", ["64"])[0])
        with lock:
            state["namespaces"].add(q.get("namespace", ["demo"])[0])
            state["used"] = min(CAPACITY, state["used"] + tokens * BYTES_PER_TOKEN)
        self.send_response(204)
        self.end_headers()


servers = [http.server.ThreadingHTTPServer(hostport(flag("metrics-listen")), Metrics),
           http.server.ThreadingHTTPServer(hostport(flag("listen")), Data)]
for s in servers:
    threading.Thread(target=s.serve_forever, daemon=True).start()
done = threading.Event()


def on_term(*_):
    with lock:
        state["ready"] = 0
    done.set()


signal.signal(signal.SIGTERM, on_term)
done.wait()
time.sleep(min(0.3, float(flag("drain-timeout", "1"))))  # "drain"
for s in servers:
    s.shutdown()
sys.exit(0)
