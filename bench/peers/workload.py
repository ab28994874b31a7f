"""The workload every system runs, and the checks of what comes back.

One block is the fp16 KV of 32 tokens of a 16-layer model with 8 KV heads of
head_dim 128, K and V: 1,048,576 values, 2 MiB. Keys are 32 bytes. Block
contents are a pure function of the block's index, so a worker can rebuild
what any block must hold, and a block read back under another key is caught.
"""

from __future__ import annotations

import hashlib

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 16, 8, 128, 32
BLOCK_ELEMS = LAYERS * 2 * TOKENS * KV_HEADS * HEAD_DIM
BLOCK_BYTES = BLOCK_ELEMS * 2  # fp16
KEY_BYTES = 32
MIB = 1 << 20
GIB = 1 << 30

# Reads of a quantized codec as fp16 must come back finite and within this
# relative error (L2 norm of the difference over that of the block).
REL_ERR_LIMIT = 0.10

# Read destinations are filled with this byte before every read phase, so a
# block that never arrived reads as NaN (0xFFFF) rather than stale data.
POISON = 0xFF


class DataError(AssertionError):
    """A block read back differs from what was written."""


def block_key(run_tag: str, block: int | str) -> bytes:
    """The 32-byte key of block `block` in the run `run_tag` (unique per run)."""
    return hashlib.blake2b(f"{run_tag}/{block}".encode(), digest_size=KEY_BYTES).digest()


def fill_blocks(rows: np.ndarray, blocks: list[int]) -> None:
    """Writes block blocks[i]'s contents (standard normal fp16) into rows[i].

    rows: uint8 array of shape [len(blocks), BLOCK_BYTES].
    """
    tmp = np.empty(BLOCK_ELEMS, np.float32)
    for row, block in zip(rows, blocks):
        np.random.default_rng(block).standard_normal(out=tmp, dtype=np.float32)
        row.view(np.float16)[:] = tmp


def check_exact(got: np.ndarray, want: np.ndarray, blocks: list[int]) -> None:
    """Raises DataError unless each row of got equals that of want bit for bit."""
    for row, (g, w) in enumerate(zip(got, want)):
        if not np.array_equal(g, w):
            first = int(np.flatnonzero(g != w)[0])
            raise DataError(
                f"block {blocks[row]}: bytes differ from byte {first} on "
                f"(got {g[first]:#04x}, wrote {w[first]:#04x})"
            )


def check_close(got: np.ndarray, want: np.ndarray, blocks: list[int]) -> None:
    """Raises DataError unless each fp16 row of got is finite and within
    REL_ERR_LIMIT of the row of want (uint8 rows holding fp16 values)."""
    for row, (g, w) in enumerate(zip(got, want)):
        g32 = g.view(np.float16).astype(np.float32)
        w32 = w.view(np.float16).astype(np.float32)
        if not np.isfinite(g32).all():
            bad = int(np.flatnonzero(~np.isfinite(g32))[0])
            raise DataError(f"block {blocks[row]}: element {bad} is {g32[bad]}")
        rel = float(np.linalg.norm(g32 - w32) / np.linalg.norm(w32))
        if not rel < REL_ERR_LIMIT:
            raise DataError(
                f"block {blocks[row]}: relative error {rel:.4f} >= {REL_ERR_LIMIT}"
            )


def check_raw(got: np.ndarray, lengths: list[int], want_length: int,
              blocks: list[int]) -> None:
    """Raises DataError unless every raw block has the codec's encoded length
    and its bytes were written (not all still the POISON byte)."""
    if len(lengths) != len(blocks):
        raise DataError(f"{len(lengths)} raw lengths for {len(blocks)} blocks")
    for row, length in enumerate(lengths):
        if length != want_length:
            raise DataError(
                f"block {blocks[row]}: raw length {length}, codec's is {want_length}"
            )
        if (got[row, :length] == POISON).all():
            raise DataError(f"block {blocks[row]}: raw bytes never arrived")
