"""Retrying object-storage requests: transient failures (resets, timeouts, 5xx, throttling,
short bodies) with jittered backoff for ``Transfer.retry_seconds``; then, and at once for
anything else, a ``PackerError`` saying what failed."""
from __future__ import annotations

import errno
import random
import time
from typing import Callable, Iterable, TypeVar

from ..errors import PackerError
from .urls import redact_text

T = TypeVar("T")


class NotFound(PackerError):
    """The object does not exist (its message says which and what to check)."""


class ShortBody(ConnectionError):
    """A response body of the wrong length (a connection cut mid-body): retried."""


# Exception class names (anywhere in the MRO) that mean "the network or the server had a
# moment": matched by name so that no client library is imported to classify its errors.
TRANSIENT_NAMES = {
    "ConnectionError", "TimeoutError", "HTTPClientError", "IncompleteRead", "IncompleteReadError",
    "ResponseStreamingError", "ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError",
    "ClientPayloadError", "ClientConnectionError", "ServerDisconnectedError", "ClientOSError",
    "FSTimeoutError", "ProtocolError", "ChunkedEncodingError", "RemoteDisconnected",
    "ServiceResponseError", "ServiceRequestError", "TransportError", "ResponseParserError",
}
TRANSIENT_ERRNOS = {errno.EBUSY, errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                    errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE, getattr(errno, "EREMOTEIO", 121)}
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
             FileExistsError, PackerError)
THROTTLE_WORDS = ("slowdown", "slow down", "throttl", "too many requests", "rate exceeded",
                  "reduce your request rate", "serviceunavailable", "service unavailable",
                  "internalerror", "internal error", "bad gateway", "gateway timeout")


def transient(e: BaseException) -> bool:
    """Whether ``e`` is a failure another try may not meet (see the module docstring)."""
    if isinstance(e, PERMANENT):
        return False
    for x in (e, e.__cause__):  # s3fs raises OSError "from" the client's error
        status = _status(x) if x is not None else None
        if status is not None:
            return status >= 500 or status in (408, 429)
    if any(c.__name__ in TRANSIENT_NAMES for x in (e, e.__cause__) for c in type(x).__mro__):
        return True
    if isinstance(e, OSError):  # s3fs: SlowDown/503 -> EBUSY, 500 -> EREMOTEIO, unknown -> EIO
        text = str(e).lower()
        return (e.errno in TRANSIENT_ERRNOS or e.errno is None
                or any(w in text for w in THROTTLE_WORDS))
    return False


def _status(e: BaseException):
    """The HTTP status an exception carries (botocore, gcsfs, aiohttp spell it differently)."""
    for attr in ("status", "code", "status_code"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        v = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return v if isinstance(v, int) else None
    return None


def with_retries(fn: Callable[[], T], what: str, seconds: float, secrets: Iterable[str] = ()) -> T:
    """``fn()``, retried while it fails transiently and ``seconds`` have not passed since the
    first failure; then a PackerError naming ``what`` and the last error (redacted)."""
    first, tries = None, 0
    while True:
        tries += 1
        try:
            return fn()
        except Exception as e:  # classified below; anything permanent is re-raised as ours
            now = time.monotonic()
            first = now if first is None else first
            reason = redact_text(f"{type(e).__name__}: {e}", secrets)[:500]
            if isinstance(e, PackerError):
                raise
            if isinstance(e, FileNotFoundError):
                raise NotFound(f"{what} failed: {reason}{advice(e)}") from None
            if not transient(e):
                raise PackerError(f"{what} failed: {reason}{advice(e)}") from None
            if now - first >= seconds:
                raise PackerError(f"{what} kept failing for {now - first:.0f} s ({tries} tries; "
                                  f"last: {reason}); check the network and the store, or raise "
                                  f"storage_options['packer_retry_seconds'], and re-run") from None
            delay = min(10.0, 0.1 * 2 ** min(tries - 1, 10)) * random.uniform(0.5, 1.0)
            time.sleep(min(delay, max(0.0, first + seconds - now)))


def advice(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return " (no such object: check the URL, and that the upload finished)"
    if isinstance(e, PermissionError) or "Credential" in type(e).__name__:
        return (" (access denied: check the credentials: storage_options, or the client's "
                "usual environment variables and config files)")
    return ""
