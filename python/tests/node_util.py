"""Starts a real kvcache-node on loopback for the Python tests.

The binary is $KVCACHE_NODE_BIN, else the tree's build/service/kvcache-node.
"""

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def node_binary() -> str:
    path = os.environ.get(
        "KVCACHE_NODE_BIN", os.path.join(ROOT, "build", "service", "kvcache-node")
    )
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no kvcache-node at {path} (set KVCACHE_NODE_BIN)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Node:
    address: str
    pid: int
    log: str


@contextlib.contextmanager
def start_node(*flags: str, memory: str = "host:512MiB", codec: str = "none"):
    """Yields a Node serving on 127.0.0.1; stops it (SIGTERM, then SIGKILL)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(
        prefix="kvcache-node-", suffix=".log", delete=False
    )
    cmd = [
        node_binary(),
        f"--listen=127.0.0.1:{port}",
        "--metrics-listen=",
        f"--memory={memory}",
        f"--default-codec={codec}",
        "--drain-timeout=1",
        "--drain-notice=0",
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvcache-node exited {proc.returncode}: "
                                   + open(log.name).read()[-2000:])
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("kvcache-node did not listen in 30 s")
            time.sleep(0.05)
        yield Node(f"127.0.0.1:{port}", proc.pid, log.name)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def stop_node(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOPs the node and returns once every one of its threads has
    stopped. os.kill only queues the signal: until a thread of the node
    takes it, the others keep answering calls (a thread busy in the kernel,
    such as the arena's prefault, can take it milliseconds late)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"/proc/{pid}/status") as status:
            if any(line.startswith("State:") and "T (stopped)" in line
                   for line in status):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvcache-node {pid} did not stop in {timeout_s} s")
        time.sleep(0.001)

