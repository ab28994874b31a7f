"""Aggregates runs into table rows (medians over rounds) and prints them.

A run (bench.run_one) is a dict with its configuration (system, path, codec,
clients, round) and per phase ('put', 'get_fp16', 'get_raw'): mib_s, lat_ms
(every batch of every client), client_cpu_s_per_gib, server_cpu_s_per_gib;
and, from the put phase, held_per_gib and rss_per_gib (bytes the server holds
per byte of fp16 KV written, by its own accounting and by the growth of its
resident anonymous memory).
"""

from __future__ import annotations

import statistics

import numpy as np


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (system, path, codec, clients, phase), in first-run order:
    median and min/max of MiB/s over rounds, p50/p99 of all batches, median
    CPU and memory figures."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for phase in run["phases"]:
            key = (run["system"], run["path"], run["codec"], run["clients"], phase)
            groups.setdefault(key, []).append(run)
    rows = []
    for (system, path, codec, clients, phase), group in groups.items():
        ph = [r["phases"][phase] for r in group]
        mib = [p["mib_s"] for p in ph]
        lat = [x for p in ph for x in p["lat_ms"]]
        row = dict(system=system, path=path, codec=codec, clients=clients,
                   phase=phase, rounds=len(group),
                   mib_s=statistics.median(mib), mib_s_min=min(mib), mib_s_max=max(mib),
                   p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99),
                   client_cpu_s_per_gib=statistics.median(
                       p["client_cpu_s_per_gib"] for p in ph),
                   server_cpu_s_per_gib=statistics.median(
                       p["server_cpu_s_per_gib"] for p in ph))
        if phase == "put":
            row["held_per_gib"] = statistics.median(r["held_per_gib"] for r in group)
            row["rss_per_gib"] = statistics.median(r["rss_per_gib"] for r in group)
        rows.append(row)
    _add_ratios(rows)
    return rows


def peer_of(row: dict) -> tuple[str, str] | None:
    """The (system, path) ours is compared with: Mooncake on the same path,
    Redis for gRPC; none for thread entries ('4t') or for the peers."""
    if row["system"] != "ours" or row["clients"].endswith("t"):
        return None
    if row["path"] == "grpc":
        return ("redis", "tcp")
    return ("mooncake", row["path"])


def _add_ratios(rows: list[dict]) -> None:
    """Sets ratio (ours MiB/s / the peer's, same clients and phase; reads
    of every format against the peer's fp16 reads) and ratio_peer."""
    index = {(r["system"], r["path"], r["clients"], r["phase"]): r for r in rows
             if r["system"] != "ours"}
    for row in rows:
        peer = peer_of(row)
        phase = "put" if row["phase"] == "put" else "get_fp16"
        other = index.get((*peer, row["clients"], phase)) if peer else None
        row["ratio_peer"] = f"{other['system']}/{other['path']}" if other else None
        row["ratio"] = row["mib_s"] / other["mib_s"] if other else None


def _fmt_ratio(row: dict) -> str:
    if row["ratio"] is None:
        return "-"
    return f"{row['ratio']:.2f} vs {row['ratio_peer']}"


def print_tables(rows: list[dict], out=print) -> None:
    """The PUT table (with memory held) and the GET table."""
    out("PUT: aggregate MiB/s of fp16 KV over all clients, median over rounds"
        " (min-max); p50/p99 per batch;")
    out("     cpu: CPU-s per GiB (clients, server); held (server's own count)"
        " and rss (its anonymous RSS growth):")
    out("     bytes per byte of fp16 KV written; ratio: ours / the peer's MiB/s,"
        " same path and clients")
    out(_header("") + f"{'held':>7}{'rss':>7}  ratio")
    for r in rows:
        if r["phase"] == "put":
            out(_line(r, "") + f"{r['held_per_gib']:>7.3f}{r['rss_per_gib']:>7.3f}  "
                + _fmt_ratio(r))
    out("")
    out("GET: the same per read format (fp16: as the caller's fp16, decoded by"
        " our client unless NODE_DECODE=1; raw: the stored encoding; MiB/s"
        " counts fp16 bytes)")
    out(_header("fmt") + "  ratio")
    for r in rows:
        if r["phase"] != "put":
            out(_line(r, r["phase"].removeprefix("get_")) + "  " + _fmt_ratio(r))


def _header(fmt: str) -> str:
    return (f"{'system':<9}{'path':<6}{'codec':<10}{fmt:<5}{'clients':>7}"
            f"{'MiB/s':>8} {'(min-max)':<13}{'p50 ms':>8}{'p99 ms':>8}"
            f"{'cli cpu':>9}{'srv cpu':>9}")


def _line(r: dict, fmt: str) -> str:
    spread = f"({r['mib_s_min']:.0f}-{r['mib_s_max']:.0f})"
    return (f"{r['system']:<9}{r['path']:<6}{r['codec']:<10}{fmt:<5}{r['clients']:>7}"
            f"{r['mib_s']:>8.0f} {spread:<13}{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}"
            f"{r['client_cpu_s_per_gib']:>9.3f}{r['server_cpu_s_per_gib']:>9.3f}")
