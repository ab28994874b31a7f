"""The peers benchmark's orchestrator (bench/peers/run.sh runs it).

For every configuration (system, path, codec, clients) and round it starts
fresh servers, spawns the client processes (worker.py), runs the phases
(put, then one get per read format) with every client starting each phase
together, measures throughput, latency, CPU and memory, and checks every
block read. Rounds are interleaved: round 1 of every configuration, then
round 2, and so on. Prints the tables of report.py and writes all runs and
rows as JSON. Exits 1 at the first failure (a wrong block included), 2 on a
bad configuration. Knobs: README.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import report
import servers
import worker
from workload import BLOCK_BYTES, GIB, MIB

PATHS_OF = {"ours": ["grpc", "tcp", "shm"], "mooncake": ["tcp", "shm"], "redis": ["tcp"]}
CODECS = ["none", "fp8_e4m3", "fp8_e5m2", "kivi2", "kivi4"]
FORMATS_OF = {"ours": None, "mooncake": ["fp16"], "redis": ["fp16"]}  # None: FORMATS


@dataclasses.dataclass
class Config:
    rounds: int
    clients: list[str]
    systems: list[str]
    paths: list[str]
    codecs: list[str]
    formats: list[str]
    blocks: int
    batch: int
    out: str
    node_bin: str
    phase_timeout_s: float
    start_timeout_s: float
    mooncake_threads: int
    keep_work: bool

    @staticmethod
    def from_env() -> "Config":
        """Knobs from the environment; QUICK=1 changes the defaults only."""
        quick = os.environ.get("QUICK") == "1"
        env = os.environ.get
        return Config(
            rounds=int(env("ROUNDS", "1" if quick else "3")),
            clients=env("CLIENTS", "1 2 2t" if quick else "1 2 4 8 4t").split(),
            systems=env("SYSTEMS", "ours mooncake redis").split(),
            paths=env("PATHS", "grpc tcp shm").split(),
            codecs=env("CODECS", "none fp8_e4m3 kivi4").split(),
            formats=env("FORMATS", "fp16 raw").split(),
            blocks=int(env("BLOCKS", "64" if quick else "512")),
            batch=int(env("BATCH", "16")),
            out=env("OUT", "/tmp/peers.json"),
            node_bin=env("NODE_BIN", ""),
            phase_timeout_s=float(env("PHASE_TIMEOUT", "300")),
            start_timeout_s=float(env("START_TIMEOUT", "30")),
            mooncake_threads=int(env("MOONCAKE_THREADS", str(os.cpu_count() or 1))),
            keep_work=env("KEEP_WORK") == "1",
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    system: str
    path: str
    codec: str
    clients: str  # "N": N processes; "Nt": N threads in one process

    def shares(self, blocks: int) -> list[list[list[int]]]:
        """Blocks per process, per thread: contiguous, equal slices."""
        n = int(self.clients.rstrip("t"))
        per = blocks // n
        slices = [list(range(i * per, (i + 1) * per)) for i in range(n)]
        return [slices] if self.clients.endswith("t") else [[s] for s in slices]

    def label(self) -> str:
        return f"{self.system} {self.path} {self.codec} x{self.clients}"


class BenchError(RuntimeError):
    pass


def plan(cfg: Config) -> list[RunConfig]:
    """Every configuration of one round, in order; raises BenchError on a
    knob that names nothing or blocks that do not split evenly."""
    known = dict(SYSTEMS=(cfg.systems, PATHS_OF), PATHS=(cfg.paths, PATHS_OF["ours"]),
                 CODECS=(cfg.codecs, CODECS), FORMATS=(cfg.formats, ["fp16", "raw"]))
    for knob, (values, allowed) in known.items():
        for v in values:
            if v not in allowed:
                raise BenchError(f"{knob}: unknown {v!r} (one of {' '.join(allowed)})")
    runs = []
    for system in cfg.systems:
        for path in (p for p in cfg.paths if p in PATHS_OF[system]):
            for codec in cfg.codecs if system == "ours" else ["none"]:
                for clients in cfg.clients:
                    if clients.endswith("t") and system != "ours":
                        continue  # threads in one process: ours only
                    n = int(clients.rstrip("t"))
                    if n < 1 or cfg.blocks % (n * cfg.batch):
                        raise BenchError(
                            f"BLOCKS={cfg.blocks} does not split into {n} clients"
                            f" of whole batches of {cfg.batch}")
                    runs.append(RunConfig(system, path, codec, clients))
    if not runs:
        raise BenchError("nothing to run: check SYSTEMS, PATHS and CLIENTS")
    return runs


def worker_env(rc: RunConfig) -> dict:
    """The environment the client processes of a run start with."""
    if rc.system == "ours":
        return servers.ucx_env(rc.path)
    if rc.system == "mooncake":
        return servers.mooncake_env()
    return {}


@contextlib.contextmanager
def patched_env(extra: dict):
    """os.environ with `extra` set, restored afterwards (spawned processes
    inherit it at start)."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Workers:
    """The client processes of one run and their messages."""

    def __init__(self, cfg: Config, rc: RunConfig, server, phases, workdir, tag):
        self.ctx = mp.get_context("spawn")
        self.queue = self.ctx.Queue()
        # "<phase>": start it; "check <phase>": every worker has timed it,
        # so checking its reads (untimed, CPU-heavy) no longer competes with
        # another worker's timed batches.
        self.events = {e: self.ctx.Event()
                       for p in phases for e in (p, f"check {p}")}
        self.timeout_s = cfg.phase_timeout_s
        self.server = server
        self.logs = []
        self.procs = []
        self.pending = []
        for wid, shares in enumerate(rc.shares(cfg.blocks)):
            log = os.path.join(workdir, f"worker-{wid}.log")
            spec = worker.WorkerSpec(
                wid=wid, system=rc.system, codec=rc.codec, server=server.client_info,
                shares=shares, run_tag=tag, phases=phases, batch=cfg.batch,
                phase_timeout_s=cfg.phase_timeout_s, log_path=log)
            self.logs.append(log)
            self.procs.append(self.ctx.Process(target=worker.main, daemon=True,
                                               args=(spec, self.queue, self.events)))

    def start(self, env: dict) -> None:
        with patched_env(env):
            for p in self.procs:
                p.start()

    def collect(self, kind: str, phase: str | None = None) -> list[tuple]:
        """One `kind` message from every worker (for `phase`), in worker order.
        Messages of another kind or phase that arrive meanwhile wait in
        self.pending. Raises
        BenchError on a worker's error, death, a dead server, or when the
        phase timeout passes."""
        def wanted(msg: tuple) -> bool:
            return msg[0] == kind and (phase is None or msg[2] == phase)

        got = {m[1]: m for m in self.pending if wanted(m)}
        self.pending = [m for m in self.pending if not wanted(m)]
        deadline = time.monotonic() + self.timeout_s
        while len(got) < len(self.procs):
            try:
                msg = self.queue.get(timeout=0.5)
            except queue_mod.Empty:
                self._check(got, kind, deadline)
                continue
            if msg[0] == "error":
                raise BenchError(f"worker {msg[1]} failed:\n{msg[2]}")
            if not wanted(msg):
                self.pending.append(msg)
            elif msg[1] in got:
                raise BenchError(f"worker {msg[1]} sent {kind} twice")
            else:
                got[msg[1]] = msg
        return [got[w] for w in sorted(got)]

    def _check(self, got: dict, kind: str, deadline: float) -> None:
        for wid, p in enumerate(self.procs):
            if wid not in got and p.exitcode is not None:
                raise BenchError(f"worker {wid} exited {p.exitcode} while the"
                                 f" orchestrator waited for '{kind}':\n"
                                 + servers.tail(self.logs[wid]))
        self.server.check_alive()
        if time.monotonic() > deadline:
            raise BenchError(f"no '{kind}' from every worker in {self.timeout_s} s")

    def join(self) -> None:
        for wid, p in enumerate(self.procs):
            p.join(30)
            if p.exitcode != 0:
                raise BenchError(f"worker {wid} exit code {p.exitcode}")

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(10)


def _phase_result(timed: list[tuple], nbytes: int, server_cpu_s: float) -> dict:
    stats = [m[3] for m in timed]
    wall = max(s["t1"] for s in stats) - min(s["t0"] for s in stats)
    gib = nbytes / GIB
    return dict(wall_s=wall, mib_s=nbytes / MIB / wall,
                lat_ms=[x for s in stats for x in s["lat_ms"]],
                client_cpu_s_per_gib=sum(s["cpu_s"] for s in stats) / gib,
                server_cpu_s_per_gib=server_cpu_s / gib)


def run_one(cfg: Config, rc: RunConfig, rnd: int, workdir: str) -> dict:
    """One run of one configuration on fresh servers; returns its figures."""
    formats = FORMATS_OF[rc.system] or cfg.formats
    phases = ["put"] + [f"get_{f}" for f in formats]
    nbytes = cfg.blocks * BLOCK_BYTES
    tag = f"{rnd}-{rc.system}-{rc.path}-{rc.codec}-{rc.clients}-{time.time_ns()}"
    result = dict(system=rc.system, path=rc.path, codec=rc.codec,
                  clients=rc.clients, round=rnd, phases={})
    with servers.start(rc.system, rc.path, rc.codec, workdir, cfg) as server:
        workers = Workers(cfg, rc, server, phases, workdir, tag)
        try:
            workers.start(worker_env(rc))
            workers.collect("ready")
            held0, rss0 = server.held_bytes(), server.rss_bytes()
            for phase in phases:
                cpu0 = server.cpu_seconds()
                workers.events[phase].set()
                timed = workers.collect("timed", phase)
                cpu1 = server.cpu_seconds()
                workers.events[f"check {phase}"].set()
                if phase == "put":
                    result["held_bytes"] = server.held_bytes() - held0
                    result["rss_bytes"] = server.rss_bytes() - rss0
                    result["held_per_gib"] = result["held_bytes"] / nbytes
                    result["rss_per_gib"] = result["rss_bytes"] / nbytes
                workers.collect("checked", phase)
                result["phases"][phase] = _phase_result(timed, nbytes, cpu1 - cpu0)
            workers.collect("done")
            workers.join()
        finally:
            workers.stop()
    return result


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine_info(cfg: Config) -> dict:
    def pkg(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    node = cfg.node_bin
    return dict(
        host=platform.node(), cpus=os.cpu_count(), kernel=platform.release(),
        python=platform.python_version(),
        node_bin=node, node_mtime=time.ctime(os.path.getmtime(node)) if node else None,
        kvcache=pkg("kvcache"), mooncake=pkg("mooncake-transfer-engine-non-cuda"),
        redis_py=pkg("redis"), numpy=pkg("numpy"),
        redis_server=_version(["redis-server", "--version"]))


def _summary(result: dict, seconds: float) -> str:
    parts = [f"{p} {r['mib_s']:.0f}" for p, r in result["phases"].items()]
    return ", ".join(parts) + f" MiB/s; held {result['held_per_gib']:.3f}" \
        f" ({seconds:.1f} s)"


def main() -> int:
    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds: servers and workers stop

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    cfg = Config.from_env()
    try:
        configs = plan(cfg)
    except BenchError as e:
        print(f"peers: {e}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="peers-")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_start = loadavg()
    print(f"peers: {len(configs)} configurations x {cfg.rounds} rounds, "
          f"{cfg.blocks} blocks of {BLOCK_BYTES >> 20} MiB, batches of {cfg.batch}")
    print(f"peers: load at start {load_start}")
    runs, total = [], len(configs) * cfg.rounds
    keep = cfg.keep_work  # the logs of a failed run are kept
    try:
        for rnd in range(1, cfg.rounds + 1):
            for rc in configs:
                rundir = os.path.join(workdir, f"run-{len(runs) + 1}")
                os.mkdir(rundir)
                t = time.monotonic()
                try:
                    runs.append(run_one(cfg, rc, rnd, rundir))
                except (BenchError, servers.StartError, RuntimeError) as e:
                    keep = True
                    print(f"peers: FAILED round {rnd} {rc.label()}: {e}", file=sys.stderr)
                    print(f"peers: logs in {rundir}", file=sys.stderr)
                    return 1
                print(f"[{len(runs)}/{total}] round {rnd} {rc.label()}: "
                      + _summary(runs[-1], time.monotonic() - t), flush=True)
    except (KeyboardInterrupt, SystemExit):
        print("peers: interrupted; servers and clients stopped", file=sys.stderr)
        raise
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = report.aggregate(runs)
    print()
    report.print_tables(rows)
    load_end = loadavg()
    print(f"\npeers: load at start {load_start}, at end {load_end}")
    doc = dict(started=started, load_start=load_start, load_end=load_end,
               machine=machine_info(cfg), config=dataclasses.asdict(cfg),
               runs=runs, rows=rows)
    with open(cfg.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"peers: every block read was checked; results in {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
