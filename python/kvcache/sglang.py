"""An SGLang HiCache storage backend backed by the kvcache store.

SGLang loads it as a ``dynamic`` backend, with no change to SGLang::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcache",
        "module_path": "kvcache.sglang", "class_name": "KvcacheHiCacheStorage",
        "interface_v1": 1, "nodes": ["10.0.0.7:50051"]}'

What it stores. One store block per HiCache page, holding every layer of
this rank: for each layer K then V, ``[page_size][heads][head_dim]`` in the
pool's dtype (fp16 or bf16; the namespace's source dtype), whatever the host
pool's layout (``layer_first``, ``page_first``, ``page_first_direct``,
``page_head``): pages are located with the pool's own
``get_page_buffer_meta`` and gathered into (or scattered from) the store's
block order, so pools of different layouts share blocks. Keys are SGLang's
own page hashes (a SHA-256 hex string becomes its 32 bytes), chained to the
page before them (``extra_info.prefix_keys``) for the store's prefix-aware
eviction. The namespace is
``{namespace_prefix}{model}/{dtype}/p{page_size}/tp{rank}of{size}`` (and
``/pp{rank}of{size}`` under pipeline parallelism): one per rank.

With ``interface_v1`` SGLang calls ``batch_exists`` (the longest stored
prefix), ``batch_get_v1`` and ``batch_set_v1`` with host-pool indices; the
older ``get``/``set``/``batch_get``/``batch_set`` take flat pages in the
pool's layout and are served too. A node that is down or slow is a miss or
a failed write (False), never an exception into SGLang.

Extra config keys besides SGLang's own: ``nodes`` (list or comma-separated;
default $KVCACHE_NODES), ``namespace_prefix`` (default ``"sglang/"``),
``codec`` (none, fp8_e4m3, fp8_e5m2, kivi2, kivi4), ``timeout_s``
(default 5), ``bearer_token_file``, ``tls_ca_file``, ``tls_cert_file``,
``tls_key_file``, ``tls_server_name``, ``data_plane``.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

import kvcache
from kvcache import _shared

logger = logging.getLogger("kvcache.sglang")

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_REGISTRATION_BACKOFF_S = 10.0
# A page's axes as each host layout holds them, for its flat page
# (get_data_page) and for the pieces get_page_buffer_meta points at:
# K = the K|V axis, L = layer, T = token, H = head, D = channel. The store's
# block order is LKTHD. `pieces` is how many leading axes the pointer
# pieces of one page split (layer_first: one piece per layer and K|V).
_LAYOUTS = {
    "layer_first": {"flat": "KLTHD", "pointers": "LKTHD", "pieces": 2},
    "page_first": {"flat": "KTLHD", "pointers": "KTLHD", "pieces": 1},
    "page_first_direct": {"flat": "KLTHD", "pointers": "KLTHD", "pieces": 1},
    "page_head": {"flat": "KHTLD", "pointers": "KHTLD", "pieces": 1},
}
_BLOCK = "LKTHD"


def _as_view(order: str, block: np.ndarray) -> np.ndarray:
    """`block` ([L][2][T][H][D]) seen in axes `order` (a view, no copy)."""
    return block.transpose([_BLOCK.index(a) for a in order])


def _memory(ptr: int, nbytes: int) -> np.ndarray:
    """A uint16 view of host memory SGLang's pool owns (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint16 * (nbytes // 2)).from_address(ptr))


class KvcacheHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage over a kvcache ClusterClient."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        if storage_config.is_mla_model:
            raise ValueError("KvcacheHiCacheStorage stores MHA pools only (no MLA)")
        extra = dict(storage_config.extra_config or {})
        nodes = _shared.nodes(extra, "KvcacheHiCacheStorage's extra config 'nodes'")
        self._config = storage_config
        self._prefix = str(extra.get("namespace_prefix", "sglang/"))
        self._codec = str(extra.get("codec", "none"))
        self._timeout_s = float(extra.get("timeout_s", 5.0))
        self._options = _shared.client_options(extra)
        self._client = kvcache.ClusterClient(
            nodes, timeout_s=self._timeout_s, **self._options
        )
        self._spec: Optional[kvcache.NamespaceSpec] = None
        self._registered = False
        self._next_registration = 0.0
        self.counters = {"exists": 0, "hit_pages": 0, "got_pages": 0,
                         "set_pages": 0, "errors": 0}

    # ------------------------------------------------------------------
    # The host pool and the namespace
    # ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        layout = getattr(host, "layout", None)
        if layout not in _LAYOUTS:
            raise ValueError(
                f"KvcacheHiCacheStorage takes host layouts {sorted(_LAYOUTS)}, "
                f"not {layout!r}"
            )
        if host.dtype not in _DTYPES:
            raise ValueError(f"KvcacheHiCacheStorage takes fp16 or bf16, not {host.dtype}")
        if getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
            raise ValueError("KvcacheHiCacheStorage needs K and V of one head size")
        self._layout = _LAYOUTS[layout]
        self._page = host.page_size
        self._shape = (host.layer_num, 2, host.page_size, host.head_num, host.head_dim)
        cfg = self._config
        dtype = _DTYPES[host.dtype]
        model = _shared.model_id(str(cfg.model_name or "model"), "")
        name = (
            f"{self._prefix}{model}/{dtype}/p{host.page_size}/"
            f"tp{cfg.tp_rank}of{cfg.tp_size}"
        )
        if cfg.pp_size > 1:
            name += f"/pp{cfg.pp_rank}of{cfg.pp_size}"
        self._spec = kvcache.NamespaceSpec(
            name,
            num_layers=host.layer_num,
            num_kv_heads=host.head_num,
            head_dim=host.head_dim,
            tokens_per_block=host.page_size,
            codec=self._codec,
            dtype=dtype,
            model=model,
            tp_rank=cfg.tp_rank,
        )
        self._ensure_registered()

    @property
    def namespace(self) -> str:
        return self._spec.name if self._spec else ""

    @property
    def spec(self) -> Optional[kvcache.NamespaceSpec]:
        """This rank's namespace (set once the host pool is registered)."""
        return self._spec

    def _ensure_registered(self) -> bool:
        if self._registered:
            return True
        if self._spec is None:
            return False
        now = time.monotonic()
        if now < self._next_registration:
            return False
        try:
            self._client.register_namespace(self._spec, timeout_s=self._timeout_s)
            self._registered = True
        except kvcache.Error as e:
            self._next_registration = now + _REGISTRATION_BACKOFF_S
            logger.warning("kvcache: registering %s failed: %s", self.namespace, e)
        return self._registered

    # ------------------------------------------------------------------
    # Pages <-> store blocks
    # ------------------------------------------------------------------

    def _pages(self, host_indices: torch.Tensor) -> list[list[np.ndarray]]:
        """Per page, views of its pieces (SGLang's get_page_buffer_meta)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = len(host_indices) // self._page
        per = len(ptrs) // n
        return [
            [_memory(ptrs[i * per + j], sizes[i * per + j]) for j in range(per)]
            for i in range(n)
        ]

    def _piece_views(self, block: np.ndarray) -> list[np.ndarray]:
        """`block`'s regions, in the order of a page's pointer pieces."""
        order, lead = self._layout["pointers"], self._layout["pieces"]
        view = _as_view(order, block)
        return [view[i] for i in np.ndindex(view.shape[:lead])]

    def _gather(self, pages: list[list[np.ndarray]]) -> np.ndarray:
        staging = np.empty((len(pages),) + self._shape, np.uint16)
        for block, pieces in zip(staging, pages):
            for region, piece in zip(self._piece_views(block), pieces):
                region[...] = piece.reshape(region.shape)
        return staging

    def _scatter(self, staging: np.ndarray, pages: list[list[np.ndarray]]) -> None:
        for block, pieces in zip(staging, pages):
            for region, piece in zip(self._piece_views(block), pieces):
                piece.reshape(region.shape)[...] = region

    def _flat_to_block(self, flat: torch.Tensor) -> np.ndarray:
        order = self._layout["flat"]
        dims = dict(zip(_BLOCK, self._shape))
        page = flat.contiguous().view(torch.int16).numpy().view(np.uint16)
        page = page.reshape([dims[a] for a in order])
        return np.ascontiguousarray(page.transpose([order.index(a) for a in _BLOCK]))

    def _block_to_flat(self, block: np.ndarray) -> torch.Tensor:
        flat = np.ascontiguousarray(_as_view(self._layout["flat"], block)).reshape(-1)
        return torch.from_numpy(flat.view(np.int16)).view(self.mem_pool_host.dtype)

    def _parents(self, keys: list[bytes], extra_info) -> list[bytes]:
        prefix = getattr(extra_info, "prefix_keys", None) or []
        first = _shared.store_key(prefix[-1]) if prefix else b""
        return [first] + [b""] * (len(keys) - 1)

    # ------------------------------------------------------------------
    # HiCacheStorage, interface v1 (zero copy from the host pool)
    # ------------------------------------------------------------------

    def batch_exists(
        self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        if not keys or not self._ensure_registered():
            return 0
        self.counters["exists"] += 1
        try:
            hit = self._client.lookup(
                self.namespace, _shared.store_keys(keys),
                timeout_s=self._timeout_s,
            ).prefix_blocks
        except kvcache.Error as e:
            self.counters["errors"] += 1
            logger.warning("kvcache lookup failed (a miss): %s", e)
            return 0
        self.counters["hit_pages"] += hit
        return hit

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if not keys:
            return []
        staging = self._read(_shared.store_keys(keys))
        if staging is None:
            return [False] * len(keys)
        got = len(staging)
        if got:
            pages = self._pages(host_indices[: got * self._page])
            self._scatter(staging, pages)
        self.counters["got_pages"] += got
        return [i < got for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if not keys:
            return []
        staging = self._gather(self._pages(host_indices))
        ok = self._write(_shared.store_keys(keys), staging, extra_info)
        return [ok] * len(keys)

    def _read(self, keys: list[bytes]) -> Optional[np.ndarray]:
        """The longest stored prefix of `keys` as blocks; None on an error."""
        if not self._ensure_registered():
            return None
        staging = np.empty((len(keys),) + self._shape, np.uint16)
        try:
            read = self._client.get_layerwise(
                self.namespace, keys, staging, timeout_s=self._timeout_s
            )
            # Layers are delivered in order: the last one means all.
            got = read.wait_layer(self._shape[0] - 1)
        except kvcache.Error as e:
            self.counters["errors"] += 1
            logger.warning("kvcache read failed (a miss): %s", e)
            return None
        return staging[:got]

    def _write(self, keys: list[bytes], staging: np.ndarray, extra_info) -> bool:
        if not self._ensure_registered():
            return False
        try:
            put = self._client.put(
                self.namespace, keys, staging,
                parent_keys=self._parents(keys, extra_info),
                timeout_s=self._timeout_s,
            )
        except kvcache.Error as e:
            self.counters["errors"] += 1
            logger.warning("kvcache write failed (pages not stored): %s", e)
            return False
        if put.why_not_stored:
            self.counters["errors"] += 1
            logger.warning("kvcache write incomplete: %s", put.why_not_stored)
            return False
        self.counters["set_pages"] += put.stored + put.skipped
        return True

    # ------------------------------------------------------------------
    # HiCacheStorage, the older interface (flat pages in the pool's layout)
    # ------------------------------------------------------------------

    def get(self, key, target_location=None, target_sizes=None):
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        staging = self._read(_shared.store_keys(keys))
        out: list = [None] * len(keys)
        if staging is None:
            return out
        for i, block in enumerate(staging):
            flat = self._block_to_flat(block)
            target = target_locations[i] if target_locations else None
            if target is not None:
                target.copy_(flat.view(target.shape))
                out[i] = target
            else:
                out[i] = flat
        return out

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        if not keys:
            return True
        staging = np.stack([self._flat_to_block(v) for v in values])
        return self._write(_shared.store_keys(keys), staging, None)

    def clear(self) -> None:
        """Drops this rank's namespace on every node (its blocks go) and
        registers it again before the next use."""
        if self._spec is None:
            return
        options = {k: v for k, v in self._options.items() if k != "data_plane"}
        for node in self._client.nodes():
            try:
                kvcache.Client(node["id"], timeout_s=self._timeout_s,
                               **options).drop_namespace(self.namespace)
            except kvcache.NotFound:
                pass
            except kvcache.Error as e:
                logger.warning("kvcache: clearing %s on %s failed: %s",
                               self.namespace, node["id"], e)
        self._registered = False
        self._next_registration = 0.0

    def get_stats(self):
        return dict(self.counters)
