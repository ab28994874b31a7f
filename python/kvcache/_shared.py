"""What the engine integrations (kvcache.vllm, kvcache.sglang) share: their
extra config's node list and client options, how a model becomes a
namespace name part, and how an engine's page key becomes a store key."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Mapping

# Extra config keys passed to kvcache.ClusterClient as they are.
CLIENT_OPTIONS = (
    "bearer_token_file",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_server_name",
    "data_plane",
)


def nodes(extra: Mapping[str, Any], where: str) -> list[str]:
    """The node list of an extra config: `nodes` (a list or comma-separated),
    else $KVCACHE_NODES. ValueError naming `where` when there is none."""
    value = extra.get("nodes", os.environ.get("KVCACHE_NODES", ""))
    if isinstance(value, str):
        value = [n.strip() for n in value.split(",") if n.strip()]
    if not value:
        raise ValueError(
            f"{where} (or KVCACHE_NODES) must list the store nodes' host:port"
        )
    return list(value)


def client_options(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The CLIENT_OPTIONS keys that `extra` sets."""
    return {k: extra[k] for k in CLIENT_OPTIONS if k in extra}


def model_id(model: str, revision: str) -> str:
    """A readable, collision-safe name part: the model's last path component
    and a hash of its full name and revision (two checkpoints that share a
    directory name never share KV)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", model.rstrip("/").split("/")[-1])
    digest = hashlib.sha256(f"{model}\0{revision}".encode()).hexdigest()[:12]
    return f"{base[:40]}-{digest}"


def store_key(key: str | bytes) -> bytes:
    """A store key (1 to 64 bytes) for an engine's page key: the bytes of a
    hex digest (SGLang's page hashes are SHA-256 hex), else the key's UTF-8
    bytes when they fit, else their SHA-256. Deterministic, so every process
    maps a page key alike."""
    if isinstance(key, bytes):
        raw = key
    else:
        if len(key) % 2 == 0 and 0 < len(key) <= 128:
            try:
                return bytes.fromhex(key)
            except ValueError:
                pass
        raw = key.encode()
    if 0 < len(raw) <= 64:
        return raw
    return hashlib.sha256(raw).digest()


def store_keys(keys) -> list[bytes]:
    """store_key of each of `keys`."""
    return [store_key(k) for k in keys]
