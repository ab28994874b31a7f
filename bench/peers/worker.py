"""A client process of the benchmark (started by bench.py, spawn context).

Protocol with the orchestrator, over one queue (messages are tuples whose
first two fields are the kind and the worker id):

  ("ready", wid)                    connected, buffers filled, warmed up
  then for each phase, once its event is set:
  ("timed", wid, phase, stats)      the phase's operations are done
  ("checked", wid, phase)           its reads were verified (gets)
  ("done", wid)                     closed cleanly
  ("error", wid, text)              anything failed; the process exits 1

stats: t0/t1 (time.monotonic of the first operation's start and the last
one's end over all threads), lat_ms (one per batch), cpu_s (user + system
CPU of this process over the phase: getrusage, all threads).
Phases are 'put' and 'get_<fmt>'. Every read is checked against what was
written before the worker says "checked"; a wrong block is an error.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import threading
import time
import traceback

import numpy as np

from workload import (BLOCK_BYTES, POISON, DataError, block_key, check_close,
                      check_exact, check_raw, fill_blocks)


@dataclasses.dataclass
class WorkerSpec:
    wid: int
    system: str
    codec: str
    server: dict
    shares: list[list[int]]  # the blocks of each thread of this process
    run_tag: str
    phases: list[str]
    batch: int
    phase_timeout_s: float
    log_path: str


@dataclasses.dataclass
class Share:
    """One thread's blocks, their keys, and where they are written from and
    read into (rows of BLOCK_BYTES)."""
    blocks: list[int]
    keys: list[bytes]
    src: np.ndarray
    dst: np.ndarray
    lengths: list[int] = dataclasses.field(default_factory=list)


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _make_share(client, spec: WorkerSpec, blocks: list[int]) -> Share:
    n = len(blocks)
    src = client.alloc(n * BLOCK_BYTES).reshape(n, BLOCK_BYTES)
    dst = client.alloc(n * BLOCK_BYTES).reshape(n, BLOCK_BYTES)
    fill_blocks(src, blocks)
    dst.fill(POISON)
    keys = [block_key(spec.run_tag, b) for b in blocks]
    return Share(blocks, keys, src, dst)


def _warm_up(client, share: Share, tag: str) -> None:
    """One untimed put and get of a block under a key of its own, from and
    into the share's buffers: connections, registrations and the server's
    first allocations are made before anything is timed. The orchestrator
    takes its memory baseline after it, so the block is not counted."""
    key = [block_key(tag, f"warm-up-{share.blocks[0]}")]
    client.put(key, share.src[:1])
    client.get(key, share.dst[:1], "fp16")
    share.dst[:1].fill(POISON)


def _run_share(client, share: Share, phase: str, batch: int, out: dict) -> None:
    """Runs one phase over one thread's share, batch by batch; records the
    first start, last end and each batch's latency into `out`."""
    fmt = phase.removeprefix("get_")
    lat = []
    share.lengths = []
    t0 = time.monotonic()
    for i in range(0, len(share.blocks), batch):
        keys = share.keys[i:i + batch]
        start = time.perf_counter()
        if phase == "put":
            client.put(keys, share.src[i:i + batch])
        else:
            share.lengths += client.get(keys, share.dst[i:i + batch], fmt)
        lat.append((time.perf_counter() - start) * 1e3)
    out.update(t0=t0, t1=time.monotonic(), lat_ms=lat)


def _run_phase(client, shares: list[Share], phase: str, batch: int) -> dict:
    """Runs `phase` on one thread per share; returns the process's stats."""
    outs = [dict() for _ in shares]
    errors = []

    def body(share, out):
        try:
            _run_share(client, share, phase, batch, out)
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)

    cpu0 = _cpu_seconds()
    if len(shares) == 1:
        body(shares[0], outs[0])
    else:
        threads = [threading.Thread(target=body, args=a) for a in zip(shares, outs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    cpu1 = _cpu_seconds()
    if errors:
        raise errors[0]
    return dict(t0=min(o["t0"] for o in outs), t1=max(o["t1"] for o in outs),
                lat_ms=[x for o in outs for x in o["lat_ms"]], cpu_s=cpu1 - cpu0)


def _verify(client, share: Share, phase: str, codec: str) -> None:
    """Checks the share's reads of `phase`, then poisons dst for the next."""
    if codec == "none":
        check_exact(share.dst, share.src, share.blocks)
    elif phase == "get_fp16":
        check_close(share.dst, share.src, share.blocks)
    else:
        check_raw(share.dst, share.lengths, client.encoded_block_bytes, share.blocks)
    if codec == "none" and any(n != BLOCK_BYTES for n in share.lengths):
        raise DataError(f"lengths {share.lengths} for codec none")
    share.dst.fill(POISON)


def _redirect_output(path: str) -> None:
    """Sends this process's stdout and stderr (C libraries' logs too) to path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _serve(client, spec: WorkerSpec, queue, events: dict) -> None:
    """Fills and warms up the shares, then runs every phase when its event
    is set. The shares' buffers go with this frame, before the client closes
    (a buffer must not outlive its client)."""
    shares = [_make_share(client, spec, blocks) for blocks in spec.shares]
    for share in shares:
        _warm_up(client, share, spec.run_tag)
    queue.put(("ready", spec.wid))
    for phase in spec.phases:
        if not events[phase].wait(spec.phase_timeout_s):
            raise TimeoutError(f"no start of phase {phase} in {spec.phase_timeout_s} s")
        stats = _run_phase(client, shares, phase, spec.batch)
        queue.put(("timed", spec.wid, phase, stats))
        # Checked once every worker has timed the phase: a check run while
        # others still read took their CPU (on 2 cores, 8 processes' last
        # batches took 310-930 ms instead of 20-90).
        if not events[f"check {phase}"].wait(spec.phase_timeout_s):
            raise TimeoutError(f"no check of phase {phase} in {spec.phase_timeout_s} s")
        if phase != "put":
            for share in shares:
                _verify(client, share, phase, spec.codec)
        queue.put(("checked", spec.wid, phase))


def main(spec: WorkerSpec, queue, events: dict) -> None:
    """The worker's entry point (multiprocessing target)."""
    _redirect_output(spec.log_path)
    # The client libraries are imported by the process that uses them only
    # (the orchestrator's spawned children all import this module).
    from clients import open_client

    try:
        client = open_client(spec.system, spec.server)
        _serve(client, spec, queue, events)
        client.close()
        queue.put(("done", spec.wid))
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        queue.put(("error", spec.wid, text))
        _exit(queue, 1)
    _exit(queue, 0)


def _exit(queue, code: int) -> None:
    """Exits once the queue has sent everything, without running the client
    libraries' exit-time destructors (the clients are closed already, or
    broken: their teardown must not hold the benchmark)."""
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
