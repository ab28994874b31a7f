"""The Python binding against a real node on loopback: hashing equal to the
C++ test vectors, round trips from numpy and torch, reads into caller
memory layer by layer, the cluster client, errors by status code, and the
GIL released while a call waits on a node."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import kvcache
from node_util import start_node, stop_node

LAYERS, HEADS, DIM, T = 3, 2, 16, 8


def spec(name, codec="none", dtype="fp16", residual_tokens=None):
    return kvcache.NamespaceSpec(
        name,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        tokens_per_block=T,
        codec=codec,
        dtype=dtype,
        model="test",
        kivi_group_size=8,  # divides T and DIM
        residual_tokens=residual_tokens,
    )


def blocks(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, LAYERS * 2 * T * HEADS * DIM)).astype(np.float16)


# A fresh node for each data plane (the tests of one share it): inline gRPC,
# and UCX (over shared memory, the node's default transports).
@pytest.fixture(scope="module", params=["grpc", "auto"])
def node(request):
    flags = ["--data-plane=ucx"] if request.param == "auto" else []
    with start_node(*flags) as n:
        yield n, request.param


_PLANES = {}


@pytest.fixture
def client(node):
    n, plane = node
    c = kvcache.Client(n.address, data_plane=plane)
    _PLANES[id(c)] = plane
    return c


def client_plane(c):
    return _PLANES[id(c)]


# docs/client.md, "Block hashing": the vectors tests/block_hash_test.cc checks.
def test_block_hash_matches_the_cpp_test_vectors():
    h = kvcache.hex_key
    assert h(kvcache.block_hash_root(0)) == "3c299bea12cf2c1cff84ad20ee5bd56c"
    keys = kvcache.block_hash_chain(list(range(1, 10)), 4)
    assert [h(k) for k in keys] == [
        "e909e7a337742300b1c3da26a989a5cc",
        "c9702797e95401505ee94e0b977e952d",
    ]
    extra = kvcache.encode_extra_keys([b"lora:7", b"salt:tenant-a"])
    assert extra.hex() == (
        "02000000060000006c6f72613a370d00000073616c743a74656e616e742d61"
    )
    assert h(kvcache.block_hash_root(42)) == "6a0229e1992291fe5e425e6ac35dc53b"
    keys = kvcache.block_hash_chain(list(range(1, 10)), 4, seed=42, extra=extra)
    assert [h(k) for k in keys] == [
        "9fa1881f3e7803d93617c1388f251f9d",
        "7ca3661ad4b5c5e50bdd6de1c7f5b947",
    ]
    tokens = [(i * 2654435761) % 2**32 for i in range(32)]
    keys = kvcache.block_hash_chain(tokens, 16, seed=2**64 - 1)
    assert [h(k) for k in keys] == [
        "19ee68e286d0342a240e5b5a865e7998",
        "78b7fd88d4ce1ccd849feb58b8f1d175",
    ]
    # block_hash_next chains exactly like block_hash_chain.
    parent = kvcache.block_hash_root(42)
    for i, key in enumerate(keys[:0]):
        parent = kvcache.block_hash_next(parent, tokens[i * 16 : (i + 1) * 16])
        assert parent == key


def test_block_hash_next_is_the_chain():
    tokens = list(range(100, 140))
    keys = kvcache.block_hash_chain(tokens, 8, seed=5)
    parent = kvcache.block_hash_root(5)
    for i, key in enumerate(keys):
        parent = kvcache.block_hash_next(parent, tokens[i * 8 : (i + 1) * 8])
        assert parent == key


def test_block_hash_matches_an_independent_python_xxh3():
    xxhash = pytest.importorskip("xxhash")
    seed, tokens, n = 9, list(range(7, 7 + 24)), 8
    parent = xxhash.xxh3_128(b"kvcache-block-hash-v1" + seed.to_bytes(8, "little"))
    parent = parent.digest()
    expected = []
    for i in range(3):
        body = parent + n.to_bytes(4, "little")
        body += b"".join(t.to_bytes(4, "little") for t in tokens[i * n : (i + 1) * n])
        body += (0).to_bytes(4, "little")
        parent = xxhash.xxh3_128(body).digest()
        expected.append(parent)
    assert kvcache.block_hash_chain(tokens, n, seed=seed) == expected


def test_round_trip_from_numpy(client):
    client.register_namespace(spec("np"))
    keys = kvcache.block_hash_chain(list(range(3 * T)), T, seed=1)
    data = blocks(3)
    put = client.put("np", keys, data)
    assert put.stored + put.skipped == 3
    got = client.get("np", keys)
    assert len(got) == 3 and got.indices == [0, 1, 2]
    np.testing.assert_array_equal(got.array(), data)
    assert client.lookup("np", keys).prefix_blocks == 3


def test_round_trip_from_torch(client):
    torch = pytest.importorskip("torch")
    client.register_namespace(spec("torch"))
    keys = kvcache.block_hash_chain(list(range(2 * T)), T, seed=2)
    data = torch.randn(2, LAYERS, 2, T, HEADS, DIM, dtype=torch.float16)
    client.put("torch", keys, data)
    dest = torch.zeros_like(data)
    client.get_into("torch", keys, dest).wait()
    assert torch.equal(dest, data)


def test_fp8_raw_blocks_decode_here_as_the_node_decodes(client):
    client.register_namespace(spec("fp8", codec="fp8_e4m3"))
    keys = kvcache.block_hash_chain(list(range(4 * T)), T, seed=3)
    client.put("fp8", keys, blocks(4, seed=3))
    node_side = client.get("fp8", keys).array()
    raw = client.get("fp8", keys, format="raw")
    assert raw.codecs == ["fp8_e4m3"] * 4
    for i in range(4):
        assert len(raw.raw(i)) < node_side.shape[1] * 2
        np.testing.assert_array_equal(raw.decode(i), node_side[i])
    assert np.isfinite(node_side).all()


@pytest.mark.parametrize("codec", ["fp8_e4m3", "kivi2"])
def test_fp16_reads_decode_here_by_default_as_the_node_would(node, codec):
    n, plane = node
    here = kvcache.Client(n.address, data_plane=plane)
    there = kvcache.Client(n.address, data_plane=plane, decode_on_client=False)
    ns = f"decode-{codec}"
    here.register_namespace(spec(ns, codec=codec, residual_tokens=0))
    keys = kvcache.block_hash_chain(list(range(4 * T)), T, seed=11)
    here.put(ns, keys, blocks(4, seed=11))
    node_side = there.get(ns, keys).array()
    np.testing.assert_array_equal(here.get(ns, keys).array(), node_side)
    dest = np.full_like(node_side, np.nan)
    read = here.get_into(ns, keys, dest)
    layer = node_side.shape[1] // LAYERS
    for l in range(LAYERS):
        read.wait_layer(l)
        np.testing.assert_array_equal(
            dest[:, l * layer : (l + 1) * layer],
            node_side[:, l * layer : (l + 1) * layer],
        )
    del read
    np.testing.assert_array_equal(dest, node_side)


def test_fp8_decodes_here_the_same_with_denormals_flushed(node):
    """A thread with flush-to-zero and denormals-are-zero on (what
    torch.set_flush_denormal(True) sets, as a library built with -ffast-math
    does) decodes fp8 as the node does: values spread over 16 binades, so
    many take fp8's subnormal codes."""
    torch = pytest.importorskip("torch")
    supported = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    if not supported:
        pytest.skip("this CPU has no flush-denormal mode")
    n, plane = node
    here = kvcache.Client(n.address, data_plane=plane)
    there = kvcache.Client(n.address, data_plane=plane, decode_on_client=False)
    here.register_namespace(spec("flushed", codec="fp8_e4m3"))
    keys = kvcache.block_hash_chain(list(range(4 * T)), T, seed=13)
    rng = np.random.default_rng(13)
    shape = blocks(4).shape
    data = (np.exp2(rng.uniform(-16, 0, shape)) * rng.choice([-1, 1], shape))
    here.put("flushed", keys, data.astype(np.float16))
    node_side = there.get("flushed", keys).array()
    got = {}

    def read_flushed():
        # MXCSR is per thread: only this one runs with denormals off.
        assert torch.set_flush_denormal(True)
        try:
            got["get"] = here.get("flushed", keys).array()
            dest = np.full_like(node_side, np.nan)
            here.get_into("flushed", keys, dest).wait()
            got["get_into"] = dest
        finally:
            torch.set_flush_denormal(False)

    t = threading.Thread(target=read_flushed)
    t.start()
    t.join()
    assert set(got) == {"get", "get_into"}, "the reading thread failed"
    for how in ("get", "get_into"):
        zeroed = int(np.count_nonzero((got[how] == 0) & (node_side != 0)))
        assert zeroed == 0, f"{how}: {zeroed} values read as zero"
        np.testing.assert_array_equal(got[how], node_side)


@pytest.mark.parametrize("codec", ["none", "fp8_e4m3"])
def test_get_into_whole_blocks_lands_what_a_layer_wise_read_lands(client, codec):
    ns = f"whole-{codec}"
    client.register_namespace(spec(ns, codec=codec))
    keys = kvcache.block_hash_chain(list(range(3 * T)), T, seed=9)
    data = blocks(3, seed=9)
    client.put(ns, keys, data)
    layered = np.full_like(data, np.nan)
    client.get_into(ns, keys, layered).wait()
    whole = np.full_like(data, np.nan)
    read = client.get_into(ns, keys, whole, layer_by_layer=False)
    layer = data.shape[1] // LAYERS
    read.wait_layer(0)
    np.testing.assert_array_equal(whole[:, :layer], layered[:, :layer])
    read.wait()
    np.testing.assert_array_equal(whole, layered)
    if codec == "none":
        np.testing.assert_array_equal(whole, data)


def test_get_into_a_data_buffer_layer_by_layer(client):
    client.register_namespace(spec("into"))
    keys = kvcache.block_hash_chain(list(range(5 * T)), T, seed=4)
    data = blocks(5, seed=4)
    client.put("into", keys, data)
    buf = client.allocate_buffer(data.nbytes)
    dest = buf.numpy().view(np.float16).reshape(data.shape)
    read = client.get_into("into", keys, dest)
    assert read.num_layers == LAYERS
    # The node's default data plane (UCX over shared memory) for "auto".
    assert read.over_data_plane == (client_plane(client) == "auto")
    layer = data.shape[1] // LAYERS
    for l in range(LAYERS):
        read.wait_layer(l)
        np.testing.assert_array_equal(
            dest[:, l * layer : (l + 1) * layer], data[:, l * layer : (l + 1) * layer]
        )
    del read
    np.testing.assert_array_equal(dest, data)


def test_missing_keys(client):
    client.register_namespace(spec("miss"))
    keys = kvcache.block_hash_chain(list(range(3 * T)), T, seed=5)
    client.put("miss", keys[:1], blocks(1))
    with pytest.raises(kvcache.NotFound) as e:
        client.get("miss", keys)
    assert e.value.code == "NOT_FOUND"
    got = client.get("miss", keys, allow_missing=True)
    assert got.prefix_blocks == 1 and got.missing == [1, 2]


def test_bad_input_is_invalid_argument(client):
    client.register_namespace(spec("bad"))
    keys = kvcache.block_hash_chain(list(range(2 * T)), T)
    with pytest.raises(kvcache.InvalidArgument):
        client.put("bad", keys, np.zeros((2, 10), np.float16))  # wrong size
    with pytest.raises(kvcache.InvalidArgument, match="C-contiguous"):
        client.put("bad", keys, blocks(2)[:, ::2])
    with pytest.raises(kvcache.InvalidArgument):
        client.get("bad", keys, format="fp32")
    with pytest.raises(kvcache.InvalidArgument):
        kvcache.NamespaceSpec("x", num_layers=1, num_kv_heads=1, head_dim=8,
                              tokens_per_block=8, codec="fp7")
    # A namespace name taken by another layout.
    other = kvcache.NamespaceSpec("bad", num_layers=1, num_kv_heads=1,
                                  head_dim=8, tokens_per_block=8, codec="none")
    with pytest.raises(kvcache.FailedPrecondition):
        client.register_namespace(other)


def test_delete_stats_and_drop(client):
    client.register_namespace(spec("drop"))
    keys = kvcache.block_hash_chain(list(range(2 * T)), T, seed=6)
    client.put("drop", keys, blocks(2))
    stats = client.stats()
    assert stats["namespaces"]["drop"]["blocks"] == 2
    assert client.delete("drop", keys[:1]) == 1
    assert client.drop_namespace("drop") == 1
    with pytest.raises(kvcache.NotFound):
        client.drop_namespace("drop")


def test_cluster_client_over_three_nodes():
    with start_node() as a, start_node() as b, start_node() as c:
        nodes = [a.address, b.address, c.address]
        cluster = kvcache.ClusterClient(nodes)
        cluster.register_namespace(spec("fleet", codec="none"))
        # Rendezvous hashing over ports chosen at random: with 12 blocks one
        # node owned none in about 2% of runs ((2/3)^12 per node); with 48,
        # about one run in 10^8.
        n = 48
        tokens = list(range(n * T))
        keys = kvcache.block_hash_chain(tokens, T, seed=7)
        data = blocks(n, seed=7)
        put = cluster.put("fleet", keys, data)
        assert put.stored == n and put.why_not_stored == ""
        assert {cluster.owner_of(k) for k in keys} == set(nodes)
        assert cluster.lookup("fleet", keys).prefix_blocks == n
        np.testing.assert_array_equal(cluster.get("fleet", keys).array(), data)
        dest = np.zeros_like(data)
        read = cluster.get_layerwise("fleet", keys, dest)
        for l in range(LAYERS):
            assert read.wait_layer(l) == n
        np.testing.assert_array_equal(dest, data)
        # A node down is a miss: the prefix ends at its first key.
        stop_node(b.pid)
        try:
            first_b = next(i for i, k in enumerate(keys) if cluster.owner_of(k) == b.address)
            got = cluster.lookup("fleet", keys, timeout_s=1.5)
            assert got.prefix_blocks == first_b
        finally:
            os.kill(b.pid, signal.SIGCONT)


def test_the_gil_is_released_while_a_call_waits_on_a_node():
    with start_node() as n:
        client = kvcache.Client(n.address, data_plane="grpc")
        client.register_namespace(spec("gil"))
        keys = kvcache.block_hash_chain(list(range(T)), T)
        stop_node(n.pid)
        ticks, stop = [0], threading.Event()

        def tick():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        t = threading.Thread(target=tick)
        t.start()
        try:
            start = time.monotonic()
            with pytest.raises(kvcache.DeadlineExceeded):
                client.lookup("gil", keys, timeout_s=1.0)
            waited = time.monotonic() - start
        finally:
            stop.set()
            t.join()
            os.kill(n.pid, signal.SIGCONT)
        assert waited >= 0.9
        # The ticker ran all along: ~1 ms a tick for ~1 s.
        assert ticks[0] > 200, ticks[0]


def test_a_cancel_token_ends_a_call():
    with start_node() as n:
        client = kvcache.Client(n.address, data_plane="grpc")
        client.register_namespace(spec("cancel"))
        keys = kvcache.block_hash_chain(list(range(T)), T)
        stop_node(n.pid)
        token = kvcache.CancelToken()
        threading.Timer(0.2, token.cancel).start()
        try:
            start = time.monotonic()
            with pytest.raises(kvcache.Cancelled):
                client.lookup("cancel", keys, timeout_s=10, cancel=token)
            assert time.monotonic() - start < 5
        finally:
            os.kill(n.pid, signal.SIGCONT)


@pytest.mark.parametrize("codec", ["none", "fp8_e4m3", "kivi4"])
def test_bf16_namespaces_take_and_return_bf16(client, codec):
    torch = pytest.importorskip("torch")
    name = f"bf16-{codec}"
    # No KIVI residual window: every block is encoded at once.
    client.register_namespace(spec(name, codec=codec, dtype="bf16", residual_tokens=0))
    keys = kvcache.block_hash_chain(list(range(3 * T)), T, seed=8)
    data = torch.randn(3, LAYERS, 2, T, HEADS, DIM).to(torch.bfloat16)
    client.put(name, keys, data)
    dest = torch.empty_like(data)
    client.get_into(name, keys, dest).wait()
    assert torch.isfinite(dest.float()).all()
    if codec == "none":
        assert torch.equal(dest, data)
    else:
        err = (dest.float() - data.float()).norm() / data.float().norm()
        assert 0 < err < 0.2, err
    # The node's decode, read as uint16 bit patterns (numpy has no bf16),
    # equals the client's decode of the raw encoding.
    node_side = client.get(name, keys).array()
    assert node_side.dtype == np.uint16
    np.testing.assert_array_equal(
        node_side, dest.view(torch.int16).numpy().view(np.uint16).reshape(3, -1)
    )
    raw = client.get(name, keys, format="raw")
    for i in range(3):
        np.testing.assert_array_equal(raw.decode(i), node_side[i])
