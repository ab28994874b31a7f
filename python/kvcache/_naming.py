"""Names the engine integrations share: how a model becomes a namespace
name part, and how an engine's page key becomes a store key."""

from __future__ import annotations

import hashlib
import re


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
