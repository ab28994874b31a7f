"""A vLLM v1 KV connector backed by the kvcache store.

Use it out of tree, with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "KvcacheConnector",
        "kv_connector_module_path": "kvcache.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"nodes": ["10.0.0.7:50051"]}}'

What it stores. One store block per full vLLM block (the store's
tokens_per_block is vLLM's ``block_size``), holding every attention layer of
this tensor-parallel rank: for each layer, K then V, each ``[T][H][D]`` in
the model's dtype, fp16 or bf16 (the namespace's source dtype: the store's
codecs encode from it and decode back to it; any other dtype fails at
start-up with a clear error). Keys are the
store's v1 block hash (``kvcache.block_hash_chain``) over the request's token
ids, with extra key bytes per block for the LoRA adapter, the
``cache_salt`` and the multimodal inputs whose placeholders overlap the
block, so every process of a fleet computes the same keys and
differently-conditioned KV never shares a key.

Scheduler side. A lookup is asynchronous: the first call for a request
starts it on a thread and answers "not yet" (None), so a slow node never
blocks a scheduler step; the answer is capped so that vLLM always computes
at least the prompt's last token. A lookup that fails or times out is a miss.

Worker side. Loads are layer-wise: ``start_load_kv`` starts one read per
request into a host staging tensor and ``wait_for_layer_load(layer)`` waits
for that layer only, then scatters it into the paged cache. Saves gather
each layer's new full blocks in ``save_kv_layer`` and write them in
``wait_for_save``; both use block ids from this step's scheduler output, so a
preempted request whose blocks went to another request never stores that
request's KV under its own key. A read that fails reports its blocks through
``get_block_ids_with_load_errors`` and vLLM recomputes them (set
``kv_load_failure_policy`` to ``recompute``); a write that fails is logged
and counted, never raised into the engine.

Extra config (``kv_connector_extra_config``):
  nodes            list of "host:port" (or a comma-separated string);
                   default: the KVCACHE_NODES environment variable.
  namespace_prefix prefix of the namespace name (default "vllm/"); a tenant
                   of a node with --tenants must use one of its prefixes.
  model_id         names the model in the namespace (default: the model's
                   name or path and its revision, hashed). Processes that must
                   share KV must agree on it.
  codec            the namespace's codec: none, fp8_e4m3, kivi2, kivi4.
  seed             the block hash seed (separates fleets), default 0.
  timeout_s        deadline of a read or write (default 5).
  lookup_timeout_s deadline of a lookup (default 2).
  save_decode      also store full blocks of generated tokens (default True).
  bearer_token_file, tls_ca_file, tls_cert_file, tls_key_file,
  tls_server_name, data_plane: as kvcache.ClusterClient takes them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvcache
from kvcache import _shared

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvcache.vllm")

# The KV dtypes the store takes as a namespace's source dtype.
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_REGISTRATION_BACKOFF_S = 10.0


@dataclasses.dataclass
class _Transfer:
    """Store blocks `keys` <-> vLLM blocks `block_ids` of one request."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    parent: bytes = b""  # the key before keys[0]; empty: keys[0] is first


@dataclasses.dataclass
class KvcacheConnectorMetadata(KVConnectorMetadata):
    """What the worker does this step: reads first, then writes."""

    loads: list[_Transfer] = dataclasses.field(default_factory=list)
    saves: list[_Transfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Settings:
    nodes: list[str]
    namespace_prefix: str
    model_id: str
    codec: str
    seed: int
    timeout_s: float
    lookup_timeout_s: float
    save_decode: bool
    client_options: dict[str, Any]


def _settings(vllm_config: "VllmConfig") -> _Settings:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    nodes = _shared.nodes(extra, "KvcacheConnector's kv_connector_extra_config.nodes")
    model = vllm_config.model_config
    model_id = extra.get("model_id") or _shared.model_id(
        str(model.model), str(getattr(model, "revision", "") or "")
    )
    return _Settings(
        nodes=nodes,
        namespace_prefix=str(extra.get("namespace_prefix", "vllm/")),
        model_id=str(model_id),
        codec=str(extra.get("codec", "none")),
        seed=int(extra.get("seed", 0)),
        timeout_s=float(extra.get("timeout_s", 5.0)),
        lookup_timeout_s=float(extra.get("lookup_timeout_s", 2.0)),
        save_decode=bool(extra.get("save_decode", True)),
        client_options=_shared.client_options(extra),
    )


def namespace_name(
    settings: _Settings, dtype: str, block_size: int, tp_rank: int, tp_size: int
) -> str:
    """The namespace both roles use: the scheduler looks up rank 0's."""
    return (
        f"{settings.namespace_prefix}{settings.model_id}/{dtype}/"
        f"b{block_size}/tp{tp_rank}of{tp_size}"
    )


def _namespace_spec(
    settings: _Settings,
    kv_cache_config: "KVCacheConfig",
    block_size: int,
    dtype: str,
    tp_rank: int,
    tp_size: int,
) -> tuple["kvcache.NamespaceSpec", list[str]]:
    """The namespace of this rank and the attention layers it holds, in
    store layer order. Both roles build it from vLLM's KV cache config, so
    they agree on it; the node checks that every process registering the
    name gives the same layout."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = [] if kv_cache_config is None else kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        raise ValueError(
            "KvcacheConnector supports models with one group of attention "
            f"layers (full attention); this one has {len(groups)} KV cache groups"
        )
    spec = groups[0].kv_cache_spec
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_size_v != spec.head_size or getattr(spec, "use_mla", False):
        raise ValueError("KvcacheConnector needs K and V of one head size (no MLA)")
    layers = sorted(groups[0].layer_names, key=lambda n: (extract_layer_index(n), n))
    name = namespace_name(settings, dtype, block_size, tp_rank, tp_size)
    return (
        kvcache.NamespaceSpec(
            name,
            num_layers=len(layers),
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            tokens_per_block=block_size,
            codec=settings.codec,
            dtype=dtype,
            model=settings.model_id,
            tp_rank=tp_rank,
        ),
        layers,
    )


def _client(settings: _Settings) -> "kvcache.ClusterClient":
    return kvcache.ClusterClient(
        settings.nodes, timeout_s=settings.timeout_s, **settings.client_options
    )


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # no model-parallel group yet
        return 0


def _model_dtype(vllm_config: "VllmConfig") -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(
            f"KvcacheConnector stores the model's own KV dtype; "
            f"kv_cache_dtype={cache_dtype} is not supported (use the "
            f"store's codec option to quantize)"
        )
    dtype = vllm_config.model_config.dtype
    if dtype not in _DTYPES:
        raise ValueError(
            f"KvcacheConnector takes fp16 or bf16 KV, not {dtype}: run the "
            f"model with --dtype float16 or bfloat16, or without the connector"
        )
    return _DTYPES[dtype]


class _RequestState:
    """The scheduler's view of one request: its vLLM block ids and keys."""

    def __init__(self, request: "Request") -> None:
        self.request = request
        self.block_ids: list[int] = []
        self.keys: list[bytes] = []
        self.saved_blocks = 0  # blocks [0, saved_blocks) are in the store
        self.preemptions = 0  # request.num_preemptions when last scheduled


def _block_extras(request: "Request", block: int, block_size: int) -> bytes:
    """Extra key bytes of one block: what conditions its KV besides tokens."""
    parts: list[bytes] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{lora.lora_name}".encode())
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt:{salt}".encode())
    start, end = block * block_size, (block + 1) * block_size
    for feature in getattr(request, "mm_features", None) or []:
        pos = getattr(feature, "mm_position", None)
        ident = getattr(feature, "identifier", None)
        if pos is None or ident is None:
            continue
        if pos.offset < end and pos.offset + pos.length > start:
            parts.append(f"mm:{ident}".encode())
    return kvcache.encode_extra_keys(parts) if parts else b""


class KvcacheConnector(KVConnectorBase_V1):
    """vLLM v1 connector (role kv_both) over a kvcache ClusterClient."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ) -> None:
        super().__init__(
            vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config
        )
        self._settings = _settings(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self._dtype_name = _model_dtype(vllm_config)
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._client = _client(self._settings)
        self._registered = False
        self._next_registration = 0.0
        self.counters = {
            "lookups": 0,
            "lookup_errors": 0,
            "hit_tokens": 0,
            "loaded_blocks": 0,
            "load_errors": 0,
            "saved_blocks": 0,
            "save_errors": 0,
            "resumed_requests": 0,
        }
        rank = 0
        if role != KVConnectorRole.SCHEDULER:
            rank = _tp_rank()
        self._spec, self._layer_names = _namespace_spec(
            self._settings,
            kv_cache_config,
            self._block_size,
            self._dtype_name,
            rank,
            self._tp_size,
        )
        self._namespace = self._spec.name
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()
        self._ensure_registered()

    def _ensure_registered(self) -> bool:
        """Registers the namespace (with the nodes, and with this process's
        client, which must know a namespace's layout before it uses it).
        A node that is down now is tried again before the next use."""
        if self._registered:
            return True
        now = time.monotonic()
        if now < self._next_registration:
            return False
        try:
            self._client.register_namespace(
                self._spec, timeout_s=self._settings.lookup_timeout_s
            )
            self._registered = True
        except kvcache.Error as e:
            # Not again for a while: a down node must not cost every step.
            self._next_registration = now + _REGISTRATION_BACKOFF_S
            logger.warning("kvcache: registering %s failed: %s", self._namespace, e)
        return self._registered

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def _init_scheduler(self) -> None:
        self._lookup_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kvcache-lookup"
        )
        self._lookups: dict[str, concurrent.futures.Future] = {}
        self._hits: dict[str, int] = {}  # request id -> hit tokens
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, _Transfer] = {}

    def _state(self, request: "Request") -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(request)
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: _RequestState, blocks: int) -> list[bytes]:
        """Keys of the request's first `blocks` blocks (extends the cache)."""
        tokens = state.request.all_token_ids
        T = self._block_size
        while len(state.keys) < blocks:
            i = len(state.keys)
            parent = (
                state.keys[-1]
                if state.keys
                else kvcache.block_hash_root(self._settings.seed)
            )
            state.keys.append(
                kvcache.block_hash_next(
                    parent,
                    list(tokens[i * T : (i + 1) * T]),
                    _block_extras(state.request, i, T),
                )
            )
        return state.keys[:blocks]

    def _lookup(self, keys: list[bytes]) -> int:
        if not self._ensure_registered():
            raise kvcache.Unavailable(f"namespace {self._namespace} not registered")
        return self._client.lookup(
            self._namespace, keys, timeout_s=self._settings.lookup_timeout_s
        )

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        T = self._block_size
        # vLLM must compute at least the last token: never hit all of them.
        max_blocks = (request.num_tokens - 1) // T
        if max_blocks * T <= num_computed_tokens:
            return 0, False
        req_id = request.request_id
        if req_id not in self._hits:
            future = self._lookups.get(req_id)
            if future is None:
                keys = self._keys(self._state(request), max_blocks)
                self._lookups[req_id] = self._lookup_pool.submit(self._lookup, keys)
                self.counters["lookups"] += 1
                return None, False
            if not future.done():
                return None, False
            del self._lookups[req_id]
            try:
                prefix = int(future.result())
            except kvcache.Error as e:
                self.counters["lookup_errors"] += 1
                logger.warning("kvcache lookup failed, recomputing: %s", e)
                prefix = 0
            self._hits[req_id] = min(prefix, max_blocks) * T
        return max(self._hits[req_id] - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        hit = self._hits.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        T = self._block_size
        first, end = (hit - num_external_tokens) // T, hit // T
        state = self._state(request)
        block_ids = blocks.get_block_ids()[0]
        keys = self._keys(state, end)
        self._pending_loads[request.request_id] = _Transfer(
            request.request_id, keys[first:end], list(block_ids[first:end])
        )
        # Those blocks are in the store already: do not write them back.
        state.saved_blocks = max(state.saved_blocks, end)
        self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(
        self, scheduler_output: "SchedulerOutput"
    ) -> KVConnectorMetadata:
        meta = KvcacheConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._plan_saves(state, done, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # After a preemption its old blocks belong to others now.
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._plan_saves(state, done, meta)
        return meta

    def _plan_saves(
        self, state: _RequestState, computed: int, meta: KvcacheConnectorMetadata
    ) -> None:
        """Writes the blocks that are full once this step has run."""
        request = state.request
        preemptions = getattr(request, "num_preemptions", 0)
        if preemptions > state.preemptions:
            self.counters["resumed_requests"] += preemptions - state.preemptions
            state.preemptions = preemptions
        limit = request.num_tokens
        if not self._settings.save_decode:
            limit = min(limit, request.num_prompt_tokens)
        full = min(computed, limit) // self._block_size
        full = min(full, len(state.block_ids))
        if full <= state.saved_blocks:
            return
        keys = self._keys(state, full)
        first = state.saved_blocks
        meta.saves.append(
            _Transfer(
                request.request_id,
                keys[first:full],
                state.block_ids[first:full],
                keys[first - 1] if first else b"",
            )
        )
        state.saved_blocks = full

    def on_new_request(self, request: "Request") -> None:
        self._state(request)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        future = self._lookups.pop(req_id, None)
        if future is not None:
            future.cancel()
        return False, None

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def _init_worker(self) -> None:
        self._layers = {name: i for i, name in enumerate(self._layer_names)}
        self._caches: list[torch.Tensor] = []
        self._reads: list[tuple[_Transfer, torch.Tensor, Any, set[int]]] = []
        self._failed_block_ids: set[int] = set()
        self._save_staging: list[tuple[_Transfer, torch.Tensor]] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"KvcacheConnector: no KV cache for layers {missing}")
        caches = [kv_caches[n] for n in self._layer_names]
        first = caches[0]
        spec = self._spec
        if (
            first.dim() != 4
            or first.dtype not in _DTYPES
            or first.shape[1] != spec.num_kv_heads
            or first.shape[3] != 2 * spec.head_dim
            or self._block_size % first.shape[2]
        ):
            raise ValueError(
                "KvcacheConnector needs per-layer [blocks, heads, tokens, K|V] "
                f"views of fp16 or bf16 matching {spec}; got {tuple(first.shape)} "
                f"{first.dtype}"
            )
        if any(t.shape != first.shape or t.dtype != first.dtype for t in caches):
            raise ValueError("KvcacheConnector needs one view shape for all layers")
        self._caches = caches
        self._heads, self._head_dim = spec.num_kv_heads, spec.head_dim
        self._kernel_ratio = self._block_size // first.shape[2]
        self._torch_dtype = first.dtype

    def _kernel_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """vLLM block ids -> the kernel block ids of the per-layer views."""
        r = self._kernel_ratio
        ids = torch.tensor(block_ids, dtype=torch.long)
        return (ids[:, None] * r + torch.arange(r)[None, :]).reshape(-1)

    def _staging(self, n: int) -> torch.Tensor:
        """Host store blocks: [n][layer][K or V][T][H][D]."""
        return torch.empty(
            (n, len(self._caches), 2, self._block_size, self._heads, self._head_dim),
            dtype=self._torch_dtype,
        )

    def _gather(self, layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """[n][K or V][T][H][D] of vLLM blocks `block_ids` of one layer."""
        n, r, D = len(block_ids), self._kernel_ratio, self._head_dim
        x = layer[self._kernel_blocks(block_ids).to(layer.device)]  # [n*r,H,N,C]
        x = x.reshape(n, r, self._heads, -1, 2 * D).permute(0, 1, 3, 2, 4)
        x = x.reshape(n, self._block_size, self._heads, 2 * D)  # [n,T,H,C]
        return torch.stack((x[..., :D], x[..., D:]), dim=1).cpu()

    def _scatter(
        self, layer: torch.Tensor, block_ids: list[int], kv: torch.Tensor
    ) -> None:
        """Writes [n][K or V][T][H][D] into vLLM blocks `block_ids`."""
        n, r = len(block_ids), self._kernel_ratio
        x = torch.cat((kv[:, 0], kv[:, 1]), dim=-1)  # [n,T,H,C]
        x = x.reshape(n, r, -1, self._heads, 2 * self._head_dim)
        x = x.permute(0, 1, 3, 2, 4).reshape(n * r, self._heads, -1, 2 * self._head_dim)
        layer[self._kernel_blocks(block_ids).to(layer.device)] = x.to(layer.device)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcacheConnectorMetadata)
        self._reads = []
        for load in meta.loads:
            staging = self._staging(len(load.keys))
            try:
                if not self._ensure_registered():
                    raise kvcache.Unavailable("namespace not registered")
                read = self._client.get_layerwise(
                    self._namespace,
                    load.keys,
                    staging.view(len(load.keys), -1),
                    timeout_s=self._settings.timeout_s,
                )
            except kvcache.Error as e:
                logger.warning("kvcache read failed, recomputing: %s", e)
                self._fail(load.block_ids)
                continue
            self._reads.append((load, staging, read, set()))

    def _fail(self, block_ids: list[int]) -> None:
        self.counters["load_errors"] += len(block_ids)
        self._failed_block_ids.update(block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is None:
            return
        for load, staging, read, failed in self._reads:
            if failed:
                continue
            try:
                read.wait_layer(layer)
                loaded = read.prefix_blocks
            except kvcache.Error as e:
                logger.warning("kvcache read failed, recomputing: %s", e)
                loaded = 0
            if loaded < len(load.keys):
                failed.add(1)
                self._fail(load.block_ids[loaded:])
            if loaded:
                self._scatter(
                    self._caches[layer], load.block_ids[:loaded], staging[:loaded, layer]
                )
            if layer == len(self._caches) - 1 and not failed:
                self.counters["loaded_blocks"] += loaded

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        layer = self._layers.get(layer_name)
        if layer is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcacheConnectorMetadata)
        if layer == 0:
            self._save_staging = [
                (save, self._staging(len(save.keys))) for save in meta.saves
            ]
        for save, staging in self._save_staging:
            staging[:, layer] = self._gather(kv_layer, save.block_ids)

    def wait_for_save(self) -> None:
        saves, self._save_staging = self._save_staging, []
        self._reads = []
        for save, staging in saves:
            try:
                if not self._ensure_registered():
                    raise kvcache.Unavailable("namespace not registered")
                # The chain's links: the first block's parent may have been
                # written in an earlier step; the others follow in this put.
                parents = [save.parent] + [b""] * (len(save.keys) - 1)
                self._client.put(
                    self._namespace,
                    save.keys,
                    staging.view(len(save.keys), -1),
                    parent_keys=parents,
                    timeout_s=self._settings.timeout_s,
                )
                self.counters["saved_blocks"] += len(save.keys)
            except kvcache.Error as e:
                self.counters["save_errors"] += len(save.keys)
                logger.warning("kvcache write failed (blocks not stored): %s", e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        pool = getattr(self, "_lookup_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
