"""The servers of each system: started fresh for one run, on loopback only,
every wait bounded, always stopped (SIGTERM, then SIGKILL).

start(system, path, codec, ...) yields a Server:
  client_info   what clients.open_client needs to reach it
  cpu_seconds() user + system CPU of its processes so far (/proc/PID/stat)
  held_bytes()  KV bytes the server says it holds (its own accounting)
  rss_bytes()   resident private anonymous memory of its processes
Server processes die with the orchestrator (PR_SET_PDEATHSIG), so none is
left behind even if the orchestrator is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

import numpy as np

CLK_TCK = os.sysconf("SC_CLK_TCK")
MEMORY_BYTES = 3 << 30  # each server's KV memory (ours: arena; mooncake: segment)

# UCX transports per path of ours, for the node and its clients alike. shm
# leaves tcp out: with tcp in the list a client's endpoint to the node gets
# tcp lanes, and reads then travel as tcp data messages (measured: 1727
# MiB/s and 0.52 client CPU-s/GiB, against 6258 and 0.046 without).
UCX_TLS = {"tcp": "tcp", "shm": "posix,sysv,self"}


class StartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the orchestrator dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env,
                                start_new_session=True,
                                preexec_fn=_die_with_parent)
    finally:
        log.close()


def _stop(proc: subprocess.Popen, timeout_s: float = 15) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


def _wait_until(what: str, ready, procs, timeout_s: float, log_path: str) -> None:
    """Polls ready() until it is true; raises StartError with the log's tail
    when timeout_s passes or one of procs exits first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for p in procs:
            if p.poll() is not None:
                raise StartError(f"{what} exited {p.returncode}:\n{tail(log_path)}")
        if time.monotonic() > deadline:
            raise StartError(f"{what} not ready in {timeout_s} s:\n{tail(log_path)}")
        time.sleep(0.05)


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def _proc_anon_bytes(pid: int) -> int:
    """Resident private anonymous memory (RssAnon): the server's heap and KV
    arena or segment, without shared memory it maps from its clients."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


class Server:
    def __init__(self, procs: list[subprocess.Popen], client_info: dict, held):
        self.procs = procs
        self.client_info = client_info
        self._held = held

    def cpu_seconds(self) -> float:
        return sum(_proc_cpu_seconds(p.pid) for p in self.procs)

    def rss_bytes(self) -> int:
        return sum(_proc_anon_bytes(p.pid) for p in self.procs)

    def held_bytes(self) -> int:
        return self._held()

    def check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"server {p.args[0]} exited {p.returncode}")


def ucx_env(path: str) -> dict:
    """The environment of ours for `path` (node and clients): UCX on lo."""
    if path not in UCX_TLS:
        return {}
    return {"UCX_TLS": UCX_TLS[path], "UCX_NET_DEVICES": "lo"}


@contextlib.contextmanager
def start_ours(node_bin: str, path: str, codec: str, workdir: str,
               timeout_s: float):
    """kvcache-node on 127.0.0.1: grpc path without a data plane, tcp/shm
    paths with the UCX data plane (UCX_TLS per UCX_TLS above)."""
    log = os.path.join(workdir, "node.log")
    cmd = [node_bin, "--listen=127.0.0.1:0", "--metrics-listen=",
           f"--memory=host:{MEMORY_BYTES >> 30}GiB", "--drain-timeout=2", "--drain-notice=0"]
    if path == "grpc":
        cmd.append("--data-plane=none")
    elif path == "shm":
        # The node's default data plane: no TCP, no listener; clients
        # connect to the worker address the control plane hands out.
        cmd.append("--data-plane=ucx")
    else:
        cmd += ["--data-plane=ucx", "--ucx-tcp-trusted-network=true",
                "--ucx-listen=127.0.0.1:0"]
    cmd += os.environ.get("NODE_FLAGS", "").split()
    proc = _spawn(cmd, log, env={**os.environ, **ucx_env(path)})
    try:
        port = []

        def serving() -> bool:
            m = re.search(r"serving gRPC on port (\d+)", tail(log, 50))
            if m:
                port.append(int(m.group(1)))
            return bool(port)

        _wait_until("kvcache-node", serving, [proc], timeout_s, log)
        address = f"127.0.0.1:{port[0]}"
        import kvcache

        stats_client = kvcache.Client(address, data_plane="grpc", timeout_s=30)
        info = {"address": address, "codec": codec,
                "data_plane": "grpc" if path == "grpc" else "ucx"}
        yield Server([proc], info, lambda: stats_client.stats()["used_bytes"])
    finally:
        _stop(proc)


def cudart_env() -> dict:
    """LD_LIBRARY_PATH for mooncake's binaries: libcudart.so.12 from the
    nvidia-cuda-runtime-cu12 wheel (see clients._preload_cudart)."""
    site = os.path.dirname(os.path.dirname(np.__file__))
    libs = glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib"))
    old = os.environ.get("LD_LIBRARY_PATH", "")
    return {"LD_LIBRARY_PATH": ":".join(libs + ([old] if old else []))}


def mooncake_env() -> dict:
    """Environment of every mooncake process, clients included: the Transfer
    Engine binds and advertises 127.0.0.1 (it picks the first non-loopback
    interface otherwise), logs warnings and errors only."""
    return {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "1"}


def _mooncake_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    return os.path.dirname(spec.origin)


def _metric(url: str, name: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    if not m:
        raise RuntimeError(f"{name} not in {url}")
    return int(float(m.group(1)))


@contextlib.contextmanager
def start_mooncake(path: str, workdir: str, timeout_s: float, threads: int):
    """mooncake_master (with its HTTP metadata server) and one mooncake_client
    (the real client owning a MEMORY segment), both on 127.0.0.1."""
    bindir = _mooncake_dir()
    env = {**os.environ, **cudart_env(), **mooncake_env()}
    rpc, http, metrics, real = free_port(), free_port(), free_port(), free_port()
    master_log = os.path.join(workdir, "mooncake_master.log")
    real_log = os.path.join(workdir, "mooncake_client.log")
    procs = []
    try:
        procs.append(_spawn([
            os.path.join(bindir, "mooncake_master"), f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics}", "--logtostderr"], master_log, env))
        _wait_until("mooncake_master",
                    lambda: _listening(rpc) and _listening(http) and _listening(metrics),
                    procs, timeout_s, master_log)
        metadata = f"http://127.0.0.1:{http}/metadata"
        procs.append(_spawn([
            os.path.join(bindir, "mooncake_client"), f"--global_segment_size={MEMORY_BYTES}",
            f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server={metadata}",
            "--host=127.0.0.1", f"--port={real}", "--protocol=tcp",
            f"--threads={threads}", "--logtostderr"], real_log, env))
        metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        _wait_until("mooncake_client",
                    lambda: _listening(real)
                    and _metric(metrics_url, "master_total_capacity_bytes") == MEMORY_BYTES,
                    procs, timeout_s, real_log)
        info = {"path": path, "master": f"127.0.0.1:{rpc}", "metadata": metadata,
                "real_client": f"127.0.0.1:{real}"}
        yield Server(procs, info,
                     lambda: _metric(metrics_url, "master_allocated_bytes"))
    finally:
        for p in reversed(procs):
            _stop(p)


@contextlib.contextmanager
def start_redis(workdir: str, timeout_s: float):
    """redis-server on 127.0.0.1, no persistence (no RDB, no AOF)."""
    import redis

    port = free_port()
    log = os.path.join(workdir, "redis.log")
    proc = _spawn(["redis-server", "--bind", "127.0.0.1", "--port", str(port),
                   "--save", "", "--appendonly", "no", "--dir", workdir,
                   "--protected-mode", "yes", "--daemonize", "no"], log)
    try:
        r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)

        def pong() -> bool:
            try:
                return r.ping()
            except redis.exceptions.ConnectionError:
                return False

        _wait_until("redis-server", pong, [proc], timeout_s, log)
        yield Server([proc], {"host": "127.0.0.1", "port": port},
                     lambda: int(r.info("memory")["used_memory"]))
    finally:
        _stop(proc)


def start(system: str, path: str, codec: str, workdir: str, cfg):
    """The context manager that starts `system`'s servers for one run."""
    if system == "ours":
        return start_ours(cfg.node_bin, path, codec, workdir, cfg.start_timeout_s)
    if system == "mooncake":
        return start_mooncake(path, workdir, cfg.start_timeout_s, cfg.mooncake_threads)
    if system == "redis":
        return start_redis(workdir, cfg.start_timeout_s)
    raise ValueError(system)
