"""Exceptions of the kvcache package: one class per status code a node or
the client answers (docs/architecture.md, "Status codes"). Every one is a
``kvcache.Error`` with ``code`` (the code's name, e.g. ``"NOT_FOUND"``) and
``retry_after_ms`` (the node's hint for ``ResourceExhausted``, else None)."""

from __future__ import annotations


class Error(Exception):
    """A call failed; ``code`` names its status code."""

    code: str = "UNKNOWN"
    retry_after_ms: int | None = None


class InvalidArgument(Error, ValueError):
    """Bad input: a key, a shape, a codec, an option."""


class NotFound(Error, KeyError):
    """A key or namespace that is not stored."""

    def __str__(self) -> str:  # KeyError quotes its argument; we do not
        return Exception.__str__(self)


class ResourceExhausted(Error):
    """The node's pool (or the tenant's quota) is full; see retry_after_ms."""


class FailedPrecondition(Error):
    """A layout mismatch, a namespace not registered, a stale lease."""


class Unavailable(Error, ConnectionError):
    """The node is down, draining or unreachable."""


class DeadlineExceeded(Error, TimeoutError):
    """The call's deadline passed."""


class Cancelled(Error):
    """The call's CancelToken was cancelled."""


class DataLoss(Error):
    """A stored block failed its checksum (the node dropped it)."""


class PermissionDenied(Error, PermissionError):
    """The tenant may not do this (namespace or role)."""


class Unauthenticated(Error, PermissionError):
    """Missing or wrong credentials."""


class Unimplemented(Error, NotImplementedError):
    """The node does not offer this."""


class OutOfRange(Error, IndexError):
    """An index past the end."""


BY_CODE = {
    "": Error,
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "FAILED_PRECONDITION": FailedPrecondition,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "CANCELLED": Cancelled,
    "DATA_LOSS": DataLoss,
    "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": Unauthenticated,
    "UNIMPLEMENTED": Unimplemented,
    "OUT_OF_RANGE": OutOfRange,
}
