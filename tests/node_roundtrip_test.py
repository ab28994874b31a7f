#!/usr/bin/env python3
"""kvcache-tool node-roundtrip against a real kvcache-node, bit for bit.

A 2-layer cache of 256 tokens (8 blocks of 32, 3 KV heads, head_dim 64)
goes through the node with each codec; what comes back must equal the
codec library's own round trip (`kvcache-tool roundtrip`) block by block,
layer by layer: fp8 every block, KIVI every block but the 4 that hold the
last 128 tokens (its residual window), which come back exact, as the
tool's report of each block's stored codec says. Exit 77 (skipped) without
NumPy.

Usage: node_roundtrip_test.py PATH/TO/kvcache-tool PATH/TO/kvcache-node
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipped (pip install -r tests/requirements.txt)")
    sys.exit(77)

TOOL, NODE = sys.argv[1], sys.argv[2]
L, T, H, D, TPB = 2, 256, 3, 64, 32


def start_node(log):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([NODE, f"--listen=127.0.0.1:{port}",
                             "--metrics-listen=", "--memory=host:256MiB",
                             "--data-plane=none"], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 20
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("kvcache-node did not listen")


def library_roundtrip(tmp, x, codec, tensor):
    """One block of one layer through `kvcache-tool roundtrip`."""
    src, dst = os.path.join(tmp, "in.npy"), os.path.join(tmp, "out.npy")
    np.save(src, x)
    subprocess.run([TOOL, "roundtrip", "--codec", codec, "--tensor", tensor,
                    src, dst], check=True, timeout=60)
    return np.load(dst)


def check_codec(tmp, node, k, v, codec):
    out_k, out_v = os.path.join(tmp, "ok.npy"), os.path.join(tmp, "ov.npy")
    p = subprocess.run([TOOL, "node-roundtrip", f"--node={node}",
                        f"--codec={codec}", os.path.join(tmp, "k.npy"),
                        os.path.join(tmp, "v.npy"), out_k, out_v],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{codec}: exit {p.returncode}: {p.stderr}"
    info = json.loads(p.stdout)
    got_k, got_v = np.load(out_k), np.load(out_v)
    kivi = codec.startswith("kivi")
    want = [codec] * (T // TPB - 4) + (["none"] * 4 if kivi else [codec] * 4)
    assert info["stored_codecs"] == want, f"{codec}: {info['stored_codecs']}"
    for b in range(T // TPB):
        s = slice(b * TPB, (b + 1) * TPB)
        for layer in range(L):
            for tensor, x, y in (("key", k, got_k), ("value", v, got_v)):
                blk = x[layer, s]
                ref = (blk if want[b] == "none" else
                       library_roundtrip(tmp, blk, codec, tensor))
                assert np.array_equal(y[layer, s].view(np.uint16),
                                      ref.view(np.uint16)), (
                    f"{codec}: block {b} layer {layer} {tensor} differs")
    print(f"ok   {codec}: {info['stored_codecs'].count(codec)} of "
          f"{T // TPB} blocks stored with the codec, the rest fp16; "
          f"bit-identical to the library")


def main():
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((L, T, H, D)) * 3).astype(np.float16)
    v = rng.standard_normal((L, T, H, D)).astype(np.float16)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(os.path.join(tmp, "k.npy"), k)
        np.save(os.path.join(tmp, "v.npy"), v)
        with open(os.path.join(tmp, "node.log"), "w") as log:
            proc, node = start_node(log)
            try:
                for codec in ("none", "fp8_e4m3", "kivi2", "kivi4"):
                    check_codec(tmp, node, k, v, codec)
                p = subprocess.run([TOOL, "node-roundtrip", "--codec=kivi2"],
                                   capture_output=True, text=True)
                assert p.returncode == 2 and "usage" in p.stderr, p.stderr
                print("ok   usage error: exit 2")
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
