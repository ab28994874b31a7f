"""The SGLang HiCache backend (kvcache.sglang) through SGLang's own code: its
storage backend factory ("dynamic" backend), real MHA host pools on CPU in
each of their layouts, their page-pointer code (get_page_buffer_meta), and a
real node. Skipped when sglang does not import, unless
KVCACHE_REQUIRE_SGLANG=1 (python/test.sh sets it)."""

import os
import signal
import time

import numpy as np
import pytest

from node_util import start_node, stop_node

try:
    import torch
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    HAVE_SGLANG = True
except ImportError:
    HAVE_SGLANG = False

if not HAVE_SGLANG and os.environ.get("KVCACHE_REQUIRE_SGLANG") == "1":
    raise RuntimeError("KVCACHE_REQUIRE_SGLANG=1 but sglang does not import")
pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed")

L, H, D, P = 3, 2, 16, 8
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def host_pool(layout, dtype):
    """A real SGLang MHA host pool on CPU over a small device pool."""
    tdtype = getattr(torch, dtype)
    tokens = 64
    k = tuple(torch.zeros(tokens, H, D, dtype=tdtype) for _ in range(L))
    v = tuple(torch.zeros(tokens, H, D, dtype=tdtype) for _ in range(L))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=P,
        head_num=H,
        head_dim=D,
        v_head_dim=D,
        dtype=tdtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info, 2.0, 0, P, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=0, end_layer=L,
    )


def backend(node_address, pool, **extra):
    """Made the way SGLang's cache controller makes it."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=pool.layout != "layer_first",
        model_name="tiny/test-model",
        extra_config={
            "backend_name": "kvcache",
            "module_path": "kvcache.sglang",
            "class_name": "KvcacheHiCacheStorage",
            "interface_v1": 1,
            "nodes": [node_address],
            "timeout_s": 2.0,
            **extra,
        },
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    storage.on_host_pools_registered()
    return storage


def logical_page(pool, page):
    """[L][K|V][T][H][D] of host page `page`, by each layout's index math
    (independent of the backend's axis mapping)."""
    buf, t0 = pool.kv_buffer, page * P
    out = torch.empty((L, 2, P, H, D), dtype=buf.dtype)
    for kv in range(2):
        for l in range(L):
            if pool.layout == "layer_first":  # [2][L][tokens][H][D]
                out[l, kv] = buf[kv, l, t0 : t0 + P]
            elif pool.layout == "page_first":  # [2][tokens][L][H][D]
                out[l, kv] = buf[kv, t0 : t0 + P, l]
            elif pool.layout == "page_first_direct":  # [2][pages][L][T][H][D]
                out[l, kv] = buf[kv, page, l]
            else:  # page_head: [2][pages][H][T][L][D]
                out[l, kv] = buf[kv, page, :, :, l].transpose(0, 1)
    return out


def fill(pool, pages, seed):
    g = torch.Generator().manual_seed(seed)
    for page in pages:
        data = pool.get_data_page(page * P, flat=False)
        data.copy_(torch.randn(data.shape, generator=g).to(data.dtype))


def indices(pages):
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def keys(n, salt="a"):
    return [f"{salt}{i:02d}".encode().hex().ljust(64, "0") for i in range(n)]


@pytest.fixture(scope="module")
def node():
    with start_node("--data-plane=ucx") as n:
        yield n


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_bit_exact_through_the_v1_interface(node, layout, dtype):
    pool = host_pool(layout, DTYPES[dtype])
    storage = backend(node.address, pool)
    assert storage.namespace.endswith(f"/{dtype}/p{P}/tp0of1")
    fill(pool, [1, 2, 3], seed=1)
    want = [logical_page(pool, p) for p in (1, 2, 3)]
    k = keys(3, salt=f"{layout}-{dtype}")
    assert storage.batch_set_v1(k, indices([1, 2, 3])) == [True] * 3
    assert storage.batch_exists(k) == 3
    assert storage.batch_exists(k[:2] + keys(1, salt="nope")) == 2
    # What the node holds is each page in the store's block order, by the
    # independent index math above.
    import kvcache

    reader = kvcache.ClusterClient([node.address])
    reader.register_namespace(storage.spec)
    stored = reader.get(storage.namespace, [bytes.fromhex(x) for x in k])
    assert len(stored) == 3
    for row, page in zip(stored.array(), want):
        assert np.array_equal(row.view(np.uint16), page.view(torch.int16).numpy().view(np.uint16).reshape(-1))
    # Into other pages of the pool.
    assert storage.batch_get_v1(k, indices([5, 6, 7])) == [True] * 3
    for got, page in zip(want, (5, 6, 7)):
        assert torch.equal(logical_page(pool, page).view(torch.int16),
                           got.view(torch.int16))
    # A missing key ends the prefix: later pages are not written.
    fill(pool, [9], seed=2)
    before = logical_page(pool, 9).clone()
    got = storage.batch_get_v1(k[:1] + keys(1, salt="nope") + k[2:],
                               indices([8, 9, 10]))
    assert got == [True, False, False]
    assert torch.equal(logical_page(pool, 9), before)


def test_pools_of_different_layouts_share_blocks(node):
    src = host_pool("layer_first", "bfloat16")
    dst = host_pool("page_head", "bfloat16")
    a, b = backend(node.address, src), backend(node.address, dst)
    assert a.namespace == b.namespace
    fill(src, [2, 4], seed=3)
    k = keys(2, salt="shared")
    assert all(a.batch_set_v1(k, indices([2, 4])))
    assert b.batch_get_v1(k, indices([0, 1])) == [True, True]
    assert torch.equal(logical_page(dst, 0), logical_page(src, 2))
    assert torch.equal(logical_page(dst, 1), logical_page(src, 4))


def test_the_older_interface_takes_flat_pages_in_the_pools_layout(node):
    pool = host_pool("page_first", "float16")
    storage = backend(node.address, pool)
    fill(pool, [3], seed=4)
    flat = pool.get_data_page(3 * P).clone()
    k = keys(1, salt="flat")[0]
    assert storage.set(k, flat)
    assert storage.exists(k)
    target = torch.zeros_like(flat)
    assert storage.get(k, target) is target
    assert torch.equal(target, flat)
    # The same block through the v1 interface, into a page of the pool.
    assert storage.batch_get_v1([k], indices([6])) == [True]
    assert torch.equal(logical_page(pool, 6), logical_page(pool, 3))


def test_prefix_keys_chain_the_first_page_and_clear_drops_the_namespace(node):
    pool = host_pool("layer_first", "float16")
    storage = backend(node.address, pool)
    fill(pool, [1, 2], seed=5)
    k = keys(2, salt="chain")
    assert all(storage.batch_set_v1(k[:1], indices([1])))
    info = HiCacheStorageExtraInfo(prefix_keys=k[:1])
    assert all(storage.batch_set_v1(k[1:], indices([2]), info))
    assert storage.batch_exists(k) == 2
    storage.clear()
    assert storage.batch_exists(k) == 0
    assert all(storage.batch_set_v1(k, indices([1, 2])))  # registered again
    assert storage.batch_exists(k) == 2


def test_a_stopped_node_is_a_miss_and_a_failed_write():
    with start_node() as n:
        pool = host_pool("page_first_direct", "float16")
        storage = backend(n.address, pool)
        fill(pool, [1], seed=6)
        k = keys(1, salt="stopped")
        assert all(storage.batch_set_v1(k, indices([1])))
        stop_node(n.pid)
        try:
            assert storage.batch_exists(k) == 0
            assert storage.batch_get_v1(k, indices([2])) == [False]
            assert storage.batch_set_v1(keys(1, salt="x"), indices([3])) == [False]
        finally:
            os.kill(n.pid, signal.SIGCONT)
        # Back once the client's backoff for the node has passed.
        deadline = time.monotonic() + 10
        while storage.batch_exists(k) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert storage.batch_exists(k) == 1
