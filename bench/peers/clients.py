"""One client adapter per system, used inside a worker process.

Every adapter offers the same four calls, each of which raises on any
failure (a benchmark must not time an error as a result):

  alloc(nbytes) -> uint8 array   memory the system moves KV from and into,
                                 registered with it where it has that notion
  put(keys, rows)                stores rows[i] (BLOCK_BYTES of fp16) under
                                 keys[i]: one batch, one call
  get(keys, rows, fmt) -> lens   reads keys[i] into rows[i]: one batch, one
                                 call; fmt 'fp16' or 'raw' (ours only);
                                 returns the bytes delivered per block
  close()

An adapter is shared by the threads of its process only where the system's
client is thread-safe (ours); the others run one thread per process.
Each adapter uses the fastest path its system documents for caller memory:
see README.md, "What each system's path is".
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import numpy as np

from workload import BLOCK_BYTES, HEAD_DIM, KV_HEADS, LAYERS, TOKENS

NAMESPACE = "peers"


class OursClient:
    """kvcache.Client against one kvcache-node.

    put: Client.put of rows that lie in one DataBuffer (Client.allocate_buffer),
    so over shared memory the node pulls them from the client's memory.
    get: Client.get_into a DataBuffer, fp16 or raw, whole blocks
    (layer_by_layer=False: the batch is waited for whole). An fp16 read of encoded
    blocks travels raw and is decoded by the client (the default,
    ClientOptions::decode_on_client), or by the node with NODE_DECODE=1.
    server: {'address', 'codec', 'data_plane' ('grpc' or 'ucx')}.
    """

    def __init__(self, server: dict):
        import kvcache

        self._plane = server["data_plane"]
        self._client = kvcache.Client(
            server["address"], data_plane=self._plane, timeout_s=120.0,
            decode_on_client=os.environ.get("NODE_DECODE") != "1",
        )
        codec = server["codec"]
        spec = kvcache.NamespaceSpec(
            NAMESPACE,
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            tokens_per_block=TOKENS,
            codec=codec,
            # No fp16 residual window: every KIVI block is stored encoded,
            # so bytes held and raw lengths are the codec's own.
            residual_tokens=0 if codec.startswith("kivi") else None,
            model="peers-bench",
        )
        info = self._client.register_namespace(spec)
        if spec.block_bytes != BLOCK_BYTES or info.codec != codec:
            raise RuntimeError(f"namespace is {info.codec}, {spec.block_bytes} B")
        self.encoded_block_bytes = info.encoded_block_bytes
        # GET_LAYER_BY_LAYER=1: layer-wise reads, as before issue 20's
        # whole-block reads (for comparison).
        self._layer_by_layer = os.environ.get("GET_LAYER_BY_LAYER") == "1"
        self._buffers = []  # DataBuffers stay alive with the adapter
        self._checked_plane = False

    def alloc(self, nbytes: int) -> np.ndarray:
        buf = self._client.allocate_buffer(nbytes)
        self._buffers.append(buf)
        return buf.numpy()

    def put(self, keys: list[bytes], rows: np.ndarray) -> None:
        res = self._client.put(NAMESPACE, keys, rows.view(np.float16))
        if res.stored != len(keys):
            raise RuntimeError(
                f"put stored {res.stored} of {len(keys)} ({res.skipped} skipped)"
            )

    def get(self, keys: list[bytes], rows: np.ndarray, fmt: str) -> list[int]:
        # A whole read (the caller waits for all of it): whole blocks, not
        # layer by layer, as Mooncake's batch_get_into moves them.
        read = self._client.get_into(NAMESPACE, keys, rows, format=fmt,
                                     stride=BLOCK_BYTES,
                                     layer_by_layer=self._layer_by_layer)
        read.wait()
        if read.missing:
            raise RuntimeError(f"get: {len(read.missing)} of {len(keys)} missing")
        if not self._checked_plane:
            self._check_plane(read.over_data_plane)
        return list(read.lengths)

    def _check_plane(self, over_data_plane: bool) -> None:
        """The path asked for is the path taken: UCX reads travel over the
        data plane, gRPC reads inline."""
        if over_data_plane != (self._plane == "ucx"):
            raise RuntimeError(
                f"data plane {self._plane} asked, read over_data_plane={over_data_plane}"
            )
        self._checked_plane = True

    def close(self) -> None:
        self._buffers.clear()
        del self._client


def _preload_cudart() -> None:
    """Loads libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel.

    mooncake-transfer-engine-non-cuda 0.3.12+ links store.so against
    libcudart.so.12 although it needs no GPU (kvcache-ai/Mooncake#3314);
    loading the library first satisfies that dependency.
    """
    site = os.path.dirname(os.path.dirname(np.__file__))
    found = glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib",
                                   "libcudart.so.12"))
    if found:
        ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)


class MooncakeClient:
    """mooncake.store.MooncakeDistributedStore against a master and one
    mooncake_client (the real client that owns the 3 GiB segment).

    path 'tcp': a full client contributing no segment (global_segment_size
    0), Transfer Engine over TCP to the segment's owner; buffers are numpy
    memory registered with register_buffer.
    path 'shm': a dummy client (setup_dummy) of the real client on this
    host: buffers come from alloc_from_mem_pool (shared memory the real client
    maps) and the real client copies between them and its segment.
    put: batch_put_from; get: batch_get_into (the zero-copy batch calls).
    server: {'path', 'master', 'metadata', 'real_client'}.
    """

    LOCAL_BUFFER = 64 << 20

    def __init__(self, server: dict):
        _preload_cudart()
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        self._path = server["path"]
        self._keep = []  # numpy arrays that back registered buffers
        if self._path == "tcp":
            rc = self._store.setup("127.0.0.1", server["metadata"], 0,
                                   self.LOCAL_BUFFER, "tcp", "", server["master"])
        else:
            rc = self._store.setup_dummy(self.LOCAL_BUFFER, self.LOCAL_BUFFER,
                                         server["real_client"])
        if rc != 0:
            raise RuntimeError(f"mooncake setup ({self._path}) returned {rc}")

    def alloc(self, nbytes: int) -> np.ndarray:
        if self._path == "tcp":
            array = np.empty(nbytes, np.uint8)
            ptr = array.ctypes.data
        else:
            ptr = self._store.alloc_from_mem_pool(nbytes)
            if not ptr:
                raise RuntimeError(f"alloc_from_mem_pool({nbytes}) failed")
            array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc}")
        self._keep.append(array)
        return array

    @staticmethod
    def _ptrs(rows: np.ndarray) -> list[int]:
        return [row.ctypes.data for row in rows]

    def put(self, keys: list[bytes], rows: np.ndarray) -> None:
        names = [k[:16].hex() for k in keys]  # 32 characters
        rcs = self._store.batch_put_from(names, self._ptrs(rows),
                                         [BLOCK_BYTES] * len(keys))
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_put_from returned {list(rcs)}")

    def get(self, keys: list[bytes], rows: np.ndarray, fmt: str) -> list[int]:
        assert fmt == "fp16"
        names = [k[:16].hex() for k in keys]
        got = list(self._store.batch_get_into(names, self._ptrs(rows),
                                              [BLOCK_BYTES] * len(keys)))
        if any(n != BLOCK_BYTES for n in got):
            raise RuntimeError(f"batch_get_into returned {got}")
        return got

    def close(self) -> None:
        self._store.close()
        self._keep.clear()


class RedisClient:
    """redis-py against one redis-server: a pipeline of one SET per block
    (non-transactional), and one MGET per batch copied into the rows.
    server: {'host', 'port'}.
    """

    def __init__(self, server: dict):
        import redis

        self._r = redis.Redis(host=server["host"], port=server["port"],
                              socket_timeout=120)
        self._r.ping()

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def put(self, keys: list[bytes], rows: np.ndarray) -> None:
        pipe = self._r.pipeline(transaction=False)
        for key, row in zip(keys, rows):
            pipe.set(key, memoryview(row))
        replies = pipe.execute()
        if not all(r is True for r in replies):
            raise RuntimeError(f"SET replies {replies}")

    def get(self, keys: list[bytes], rows: np.ndarray, fmt: str) -> list[int]:
        assert fmt == "fp16"
        values = self._r.mget(keys)
        lengths = []
        for value, row in zip(values, rows):
            if value is None or len(value) != BLOCK_BYTES:
                raise RuntimeError(f"MGET gave {None if value is None else len(value)} bytes")
            row[:] = np.frombuffer(value, np.uint8)
            lengths.append(len(value))
        return lengths

    def close(self) -> None:
        self._r.close()


ADAPTERS = {"ours": OursClient, "mooncake": MooncakeClient, "redis": RedisClient}


def open_client(system: str, server: dict):
    """The adapter of `system` connected to `server` (what servers.py gave)."""
    if system not in ADAPTERS:
        sys.exit(f"unknown system {system}")
    return ADAPTERS[system](server)
