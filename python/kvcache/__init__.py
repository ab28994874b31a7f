"""kvcache: the Python client of the kvcache KV-cache store.

``Client`` talks to one node, ``ClusterClient`` to a fleet (keys sharded by
rendezvous hashing; a node down is a miss). Blocks are C-contiguous arrays
of 16-bit values (numpy or torch, taken without copies), one row per key:
for each layer K then V, each ``[tokens][kv_heads][head_dim]``. Every call
that waits on a node releases the GIL. Errors are ``kvcache.Error``
subclasses by status code (``kvcache.errors``). Keys come from the store's
block hash (``block_hash_chain``), the same in every language.

Engines: ``kvcache.vllm.KvcacheConnector``, a vLLM v1 KV connector
(docs/engines.md).
"""

from . import errors
from ._kvcache import (
    BLOCK_HASH_VERSION,
    BLOCK_KEY_BYTES,
    CancelToken,
    Client,
    ClusterClient,
    ClusterLookupResult,
    ClusterPutResult,
    DataBuffer,
    GetResult,
    LayerRead,
    LookupResult,
    NamespaceInfo,
    NamespaceSpec,
    PendingRead,
    PutResult,
    _register_errors,
    block_hash_chain,
    block_hash_next,
    block_hash_root,
    encode_extra_keys,
    hex_key,
)
from .errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    Error,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)

_register_errors(errors.BY_CODE)
del _register_errors

__all__ = [
    "BLOCK_HASH_VERSION",
    "BLOCK_KEY_BYTES",
    "CancelToken",
    "Cancelled",
    "Client",
    "ClusterClient",
    "ClusterLookupResult",
    "ClusterPutResult",
    "DataBuffer",
    "DataLoss",
    "DeadlineExceeded",
    "Error",
    "FailedPrecondition",
    "GetResult",
    "InvalidArgument",
    "LayerRead",
    "LookupResult",
    "NamespaceInfo",
    "NamespaceSpec",
    "NotFound",
    "OutOfRange",
    "PendingRead",
    "PermissionDenied",
    "PutResult",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "block_hash_chain",
    "block_hash_next",
    "block_hash_root",
    "encode_extra_keys",
    "errors",
    "hex_key",
]
