"""Time to first layer: what a decode engine's time-to-first-token feels.

For a cached prefix of PREFIX_TOKENS tokens (default 4,096: 128 blocks of
the workload's 32 tokens, 256 MiB of fp16 KV), one decode worker does what
an engine does on a hit: a pinning Lookup of the prefix's keys, then one
GetInto of the whole prefix into registered memory, and measures

  begun:       from the Lookup call to GetInto returning (the node has
               pinned and verified the blocks: BeginRead answered, and
               the read's start is on its way);
  first layer: from the Lookup call to WaitLayer(0) returning (layer 0 of
               every block usable in its memory, as fp16);
  whole:       from the Lookup call to Wait returning (every layer).

Per path (tcp, shm; over gRPC a 256 MiB prefix is larger than one message
may be, so an engine would read it in parts) and codec, on a fresh node each, REPS reads
(after one untimed read), median and (min-max) in ms. The ratio
first/whole is how much of the read a layer-wise engine no longer waits
for before it can start layer 0's attention.

Run by `bench/peers/run.sh first-layer`; knobs: PATHS, CODECS, REPS,
PREFIX_TOKENS, NODE_BIN, NODE_FLAGS, NODE_DECODE (as bench.py's).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import clients
import servers
from workload import BLOCK_BYTES, TOKENS, block_key, fill_blocks


def _measure(client, keys: list[bytes], dest: np.ndarray) -> tuple[float, float, float]:
    """(begun, first layer, whole) seconds of one Lookup + GetInto of `keys`."""
    t0 = time.monotonic()
    hit = client.lookup(clients.NAMESPACE, keys, pin=True)
    if hit.prefix_blocks != len(keys):
        raise RuntimeError(f"lookup found {hit.prefix_blocks} of {len(keys)} blocks")
    read = client.get_into(clients.NAMESPACE, keys, dest, pin_lease=hit.pin_lease,
                           stride=BLOCK_BYTES)
    tb = time.monotonic()
    read.wait_layer(0)
    t1 = time.monotonic()
    read.wait()
    t2 = time.monotonic()
    del read
    return tb - t0, t1 - t0, t2 - t0


def _run(node_bin: str, path: str, codec: str, blocks: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="first-layer-") as work:
        with servers.start_ours(node_bin, path, codec, work, 30.0) as server:
            adapter = clients.OursClient(server.client_info)
            src = adapter.alloc(blocks * BLOCK_BYTES).reshape(blocks, BLOCK_BYTES)
            dst = adapter.alloc(blocks * BLOCK_BYTES).reshape(blocks, BLOCK_BYTES)
            fill_blocks(src, list(range(blocks)))
            keys = [block_key(f"first-layer-{path}-{codec}", b) for b in range(blocks)]
            for i in range(0, blocks, 16):
                adapter.put(keys[i:i + 16], src[i:i + 16])
            client = adapter._client
            _measure(client, keys, dst)  # untimed: connections, registrations
            begins, firsts, wholes = [], [], []
            for _ in range(reps):
                begun, first, whole = _measure(client, keys, dst)
                begins.append(begun * 1e3)
                firsts.append(first * 1e3)
                wholes.append(whole * 1e3)
            adapter.close()
    return {"path": path, "codec": codec, "begun_ms": begins, "first_ms": firsts,
            "whole_ms": wholes}


def _run_apart(path: str, codec: str, blocks: int, reps: int) -> dict:
    """_run in a process of its own, with the path's UCX environment (read
    when a UCX context is made, so it must be set before the client exists)."""
    out = subprocess.run(
        [sys.executable, __file__, "--one", path, codec, str(blocks), str(reps)],
        env={**os.environ, **servers.ucx_env(path)}, capture_output=True, text=True,
        timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{path} {codec}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        path, codec, blocks, reps = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6])
        print(json.dumps(_run(os.environ.get("NODE_BIN", ""), path, codec, blocks, reps)))
        return 0
    env = os.environ.get
    paths = env("PATHS", "tcp shm").split()
    codecs = env("CODECS", "none fp8_e4m3 kivi4").split()
    reps = int(env("REPS", "7"))
    tokens = int(env("PREFIX_TOKENS", "4096"))
    if tokens % TOKENS:
        print(f"PREFIX_TOKENS must be a multiple of {TOKENS}", file=sys.stderr)
        return 2
    blocks = tokens // TOKENS
    print(f"first-layer: a {tokens}-token prefix ({blocks} blocks, "
          f"{blocks * BLOCK_BYTES >> 20} MiB fp16), {reps} reads each; "
          f"load {open('/proc/loadavg').read().strip()}")
    print(f"{'path':5} {'codec':9} {'begun ms':>22} {'first layer ms':>22} "
          f"{'whole ms':>22} {'first/whole':>11}")
    for path in paths:
        for codec in codecs:
            r = _run_apart(path, codec, blocks, reps)
            b, f, w = r["begun_ms"], r["first_ms"], r["whole_ms"]
            mb, mf, mw = statistics.median(b), statistics.median(f), statistics.median(w)
            print(f"{path:5} {codec:9} {mb:9.1f} ({min(b):5.1f}-{max(b):6.1f})"
                  f" {mf:9.1f} ({min(f):5.1f}-{max(f):6.1f})"
                  f" {mw:9.1f} ({min(w):5.1f}-{max(w):6.1f}) {mf / mw:11.2f}",
                  flush=True)
    print(f"first-layer: load at end {open('/proc/loadavg').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
