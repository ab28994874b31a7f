"""Where the time goes: a steady-state read (or write) loop of ours under
`perf record -a`, its CPU split by process (node, clients, idle) and by what
the samples were doing.

The peers benchmark (bench.py) times one pass over 1 GiB, a phase of well
under a second; too short, and too mixed with setup, to profile. Here each of
CLIENTS processes puts its share of BLOCKS blocks once, and then, together,
all of them read it back (OP=get, into a DataBuffer, FORMATS fp16 or raw)
or write it again (OP=put) in batches of BATCH for PROFILE_SECONDS while
perf samples every CPU. The table gives each category's share of all CPU
time (every core for PROFILE_SECONDS) and its CPU-seconds per GiB of fp16
KV moved, for the node and for the clients together; "idle" is time no
process ran.

Categories, by the sample's symbol or library: kernel socket copies
(_copy_from_iter: a sender's bytes into the socket; _copy_to_iter: out of
it), the kernel's TCP/IP stack, page faults and page allocation (the
kernel's own for socket buffers included: without call graphs the two
cannot be told apart), scheduling and system-call
entry, other kernel; and in user space memcpy (with StreamCopy, the node's
copies into a client's mapped buffer), checksum (xxHash), codec
(our kernels), UCX, gRPC/protobuf/Abseil, Python and numpy, other.

Run by `bench/peers/run.sh profile`; knobs: PATHS (one of tcp, shm), CODECS
(one codec), FORMATS (one format), CLIENTS (one count), OP, PROFILE_SECONDS (10),
BLOCKS (256), BATCH (16), NODE_BIN, NODE_FLAGS; PERF_DATA=FILE keeps the
recording, PERF_CALL_GRAPH=MODE (fp, dwarf, lbr) records call graphs. Needs `perf` (linux-perf) and
kernel.perf_event_paranoid <= 1 or root. Each read is checked against what
was written once before the loop (the loop itself does not re-check).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


import clients
import servers
from workload import BLOCK_BYTES, block_key, check_close, check_exact, fill_blocks

CATEGORIES = [
    ("kernel: socket copy", lambda dso, sym: dso == "k" and sym in (
        "_copy_from_iter", "_copy_to_iter", "copy_user_generic_string",
        "copy_user_enhanced_fast_string", "rep_movs_alternative")),
    ("kernel: page faults, page allocation", lambda dso, sym: dso == "k" and re.search(
        r"clear_page|fault|folio_zero|alloc_pages|rmqueue|get_page_from_freelist",
        sym) is not None),
    ("kernel: TCP/IP stack", lambda dso, sym: dso == "k" and re.search(
        r"tcp|skb|^ip_|_ip_|net_rx|netif|loopback|inet|sock|dev_queue|softirq|"
        r"bbr|napi|process_backlog|__dev_|datagram", sym) is not None),
    ("kernel: scheduling, syscalls", lambda dso, sym: dso == "k" and re.search(
        r"schedule|sched|syscall|epoll|futex|spin|switch|wake|ep_|poll|"
        r"fdget|read_tsc|ktime|hrtimer|timer", sym) is not None),
    ("kernel: other", lambda dso, sym: dso == "k"),
    # StreamCopy (base/stream_copy.h): the node's copies into a client's mapped buffer.
    ("user: memcpy", lambda dso, sym: re.search(r"mem(move|cpy|set)|StreamCopy", sym) is not None),
    ("user: checksum", lambda dso, sym: "xxhash" in dso or sym.startswith("XXH")),
    ("user: codec", lambda dso, sym: "kernels::" in sym),
    ("user: UCX", lambda dso, sym: re.search(r"libuc[pts]", dso) is not None or
     sym.startswith(("ucp_", "uct_", "ucs_"))),
    ("user: gRPC, protobuf, Abseil", lambda dso, sym: re.search(
        r"grpc|gpr|protobuf|absl|libssl|libcrypto", dso) is not None),
    ("user: Python, numpy", lambda dso, sym: re.search(
        r"python|numpy|multiarray|cpython", dso) is not None),
    ("user: other", lambda dso, sym: True),
]


def category(dso: str, sym: str) -> str:
    for name, match in CATEGORIES:
        if match(dso, sym):
            return name
    return "user: other"


def _client(argv: list[str]) -> int:
    """One client process: puts its blocks, says ready, waits for `go`,
    loops OP for PROFILE_SECONDS, prints the fp16 bytes it moved."""
    address, codec, op, fmt, first, count, go, seconds, batch = argv
    first, count, seconds, batch = int(first), int(count), float(seconds), int(batch)
    adapter = clients.OursClient({"address": address, "codec": codec, "data_plane": "ucx"})
    src = adapter.alloc(count * BLOCK_BYTES).reshape(count, BLOCK_BYTES)
    dst = adapter.alloc(count * BLOCK_BYTES).reshape(count, BLOCK_BYTES)
    blocks = list(range(first, first + count))
    fill_blocks(src, blocks)
    keys = [block_key("profile", b) for b in blocks]
    for i in range(0, count, batch):
        adapter.put(keys[i:i + batch], src[i:i + batch])
    for i in range(0, count, batch):
        adapter.get(keys[i:i + batch], dst[i:i + batch], "fp16")
    (check_exact if codec == "none" else check_close)(dst, src, blocks)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    moved = 0
    end = time.monotonic() + seconds
    passes = 0
    while time.monotonic() < end:
        passes += 1
        # A put of a stored key is skipped: each pass writes new keys (the
        # node evicts the oldest when its pool is full, as under real load).
        pass_keys = [block_key(f"profile-{passes}", b) for b in blocks]
        for i in range(0, count, batch):
            if op == "put":
                adapter.put(pass_keys[i:i + batch], src[i:i + batch])
            else:
                adapter.get(keys[i:i + batch], dst[i:i + batch], fmt)
            moved += min(batch, count - i) * BLOCK_BYTES
    print(f"moved {moved}", flush=True)
    adapter.close()
    return 0


def _samples(perf_data: str, node_pid: int, client_pids: set[int]):
    """(group, category) -> samples, from `perf script`."""
    # One line per sample, its leaf frame: a recording with call graphs
    # (PERF_CALL_GRAPH) would otherwise print each sample's pid on a line
    # of its own and its frames below, which the pattern below never matches.
    out = subprocess.run(
        ["perf", "script", "-i", perf_data, "-F", "pid,ip,sym,dso", "--no-demangle",
         "--hide-call-graph"],
        capture_output=True, text=True, check=True).stdout
    demangle = {}
    counts = collections.Counter()
    line_re = re.compile(r"^\s*(\d+)\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")
    for line in out.splitlines():
        m = line_re.match(line)
        if not m:
            continue
        pid, sym, dso = int(m.group(1)), m.group(2), m.group(3)
        group = ("idle" if pid == 0 else "node" if pid == node_pid else
                 "clients" if pid in client_pids else "other")
        if sym.startswith("_Z"):
            demangle.setdefault(sym, sym)
        kind = "k" if dso.startswith("[kernel") else dso
        counts[(group, sym, kind)] += 1
    if demangle:
        names = subprocess.run(["c++filt"], input="\n".join(demangle), capture_output=True,
                               text=True).stdout.splitlines()
        demangle = dict(zip(demangle, names))
    result = collections.Counter()
    for (group, sym, kind), n in counts.items():
        cat = "idle" if group == "idle" else category(kind, demangle.get(sym, sym))
        result[(group, cat)] += n
    return result


def main() -> int:
    if sys.argv[1:2] == ["--client"]:
        return _client(sys.argv[2:])
    env = os.environ.get
    path, codec, fmt = env("PATHS", "tcp"), env("CODECS", "none"), env("FORMATS", "fp16")
    op, n = env("OP", "get"), int(env("CLIENTS", "1"))
    seconds = float(env("PROFILE_SECONDS", "10"))
    blocks, batch = int(env("BLOCKS", "256")), int(env("BATCH", "16"))
    if path not in ("tcp", "shm") or " " in codec + fmt or op not in ("get", "put"):
        print("profile: one of PATHS=tcp|shm, one codec, one format, OP=get|put",
              file=sys.stderr)
        return 2
    if shutil.which("perf") is None:
        print("profile: needs perf (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2
    share = blocks // n
    with tempfile.TemporaryDirectory(prefix="peers-profile-") as work, \
            servers.start_ours(env("NODE_BIN", ""), path, codec, work, 30.0) as server:
        go = os.path.join(work, "go")
        uenv = {**os.environ, **servers.ucx_env(path)}
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--client", server.client_info["address"], codec, op,
             fmt, str(i * share), str(share), go, str(seconds), str(batch)],
            stdout=subprocess.PIPE, text=True, env=uenv) for i in range(n)]
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                print(f"profile: a client failed (exit {p.wait()})", file=sys.stderr)
                return 1
        perf_data = os.path.join(work, "perf.data")
        load = open("/proc/loadavg").read().split()[0]
        open(go, "w").close()
        graph = ["--call-graph", env("PERF_CALL_GRAPH")] if env("PERF_CALL_GRAPH") else []
        perf = subprocess.run(["perf", "record", "-a", *graph, "-o", perf_data, "--", "sleep",
                               str(seconds)], capture_output=True, text=True)
        moved = 0
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 120)
            if p.returncode != 0:
                print(f"profile: a client exited {p.returncode}", file=sys.stderr)
                return 1
            moved += int(out.split()[-1])
        if perf.returncode != 0:
            print(f"profile: perf record failed: {perf.stderr[-500:]}", file=sys.stderr)
            return 1
        counts = _samples(perf_data, server.procs[0].pid, {p.pid for p in procs})
        if env("PERF_DATA"):
            shutil.copyfile(perf_data, env("PERF_DATA"))
    total = sum(counts.values())
    if total == 0 or moved == 0:
        print(f"profile: nothing to report ({total} samples read from perf's recording, "
              f"{moved} bytes moved)", file=sys.stderr)
        return 1
    gib = moved / 2**30
    cpus = os.cpu_count() or 1
    print(f"profile: ours {path} {codec} {op}{'' if op == 'put' else ' ' + fmt}, {n} client "
          f"process(es), {seconds:.0f} s: {moved / seconds / 2**20:.0f} MiB/s of fp16 KV; "
          f"{total} samples over {cpus} CPUs; load {load} at start")
    print(f"{'category':36s} {'node %':>7s} {'clients %':>9s}   "
          f"{'node CPU-s/GiB':>14s} {'clients CPU-s/GiB':>17s}")
    for cat, _ in CATEGORIES:
        row = [counts[(g, cat)] for g in ("node", "clients")]
        if not any(row):
            continue
        share_pct = [100.0 * r / total for r in row]
        per_gib = [r / total * cpus * seconds / gib for r in row]
        print(f"{cat:36s} {share_pct[0]:7.1f} {share_pct[1]:9.1f}   "
              f"{per_gib[0]:14.3f} {per_gib[1]:17.3f}")
    for group in ("node", "clients"):
        n_group = sum(v for (g, _), v in counts.items() if g == group)
        print(f"{'all of ' + group:36s} {100.0 * n_group / total:7.1f}   "
              f"{n_group / total * cpus * seconds / gib:.3f} CPU-s/GiB")
    other = sum(v for (g, _), v in counts.items() if g == "other")
    print(f"{'other processes':36s} {100.0 * other / total:7.1f}")
    print(f"{'idle':36s} {100.0 * counts[('idle', 'idle')] / total:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
