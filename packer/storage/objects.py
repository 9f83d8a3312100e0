"""Whole files to and from object storage: parallel ranged GETs hashed in order, accepted only
if length, SHA-256 and version held throughout (a failed download leaves no file); requests
failing transiently are retried with backoff for ``Transfer.retry_seconds``."""
from __future__ import annotations

import errno
import hashlib
import itertools
import os
import posixpath
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, TypeVar

from .._util.fsio import open_new
from ..errors import FormatError, PackerError
from .urls import (filesystem, is_url, redact, redact_text, secret_values, split_options,
                   url_secrets)

T = TypeVar("T")


class NotFound(PackerError):
    """The object does not exist (its message says which and what to check)."""


class Grown(PackerError):
    """An object holds more bytes than it was listed or looked up with: replaced since."""


class ShortBody(ConnectionError):
    """A response body of the wrong length (a connection cut mid-body): retried."""


# Transient exception class names (anywhere in the MRO): matched by name, importing no client.
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
    """Whether ``e`` is a failure another try may not meet: a reset, timeout, 5xx, throttling
    or short body."""
    if isinstance(e, PERMANENT):
        return False
    # s3fs raises OSError "from" the client's error, which carries the status
    status = next((s for s in map(_status, (e, e.__cause__)) if s is not None), None)
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
    first = None
    for tries in itertools.count(1):
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
        if re.search(r"nosuchbucket|bucket does not exist", str(e).lower()):  # S3's, GCS's
            return " (no such bucket: check the URL's bucket name, or create the bucket)"
        return " (no such object: check the URL, and that the upload finished)"
    if isinstance(e, PermissionError) or "Credential" in type(e).__name__:
        return (" (access denied: check the credentials: storage_options, or the client's "
                "usual environment variables and config files)")
    return ""


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    version: Optional[str]  # ETag / generation / mtime: whatever the store says changes with it


class Store:
    """A folder in object storage (``url``): read, download and upload its files.
    ``storage_options`` go to fsspec except packer's ``packer_*`` keys (``Transfer``); a Store
    pickles without its client (fsspec's async clients do not survive a fork)."""
    _pool_lock = threading.Lock()

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None):
        self.url = url.rstrip("/")
        if not is_url(self.url):  # "s3://" alone: fsspec would take "s3:" for a local path
            raise PackerError(f"{redact(url)} names no bucket (expected SCHEME://BUCKET/PATH)")
        self.shown = redact(self.url)
        self.options, self.transfer = split_options(storage_options)
        self.secrets = secret_values(self.options) + url_secrets(url)
        self.root = self.fs_root()  # and the client, made in this process
        self._pool = self._pool_pid = None

    def fs_root(self) -> str:
        fs, root = filesystem(self.url, self.options)
        self._fs, self._pid = fs, os.getpid()
        return root.rstrip("/")

    @property
    def fs(self):
        if self._pid != os.getpid():
            self.fs_root()
        return self._fs

    def __getstate__(self):
        return dict(self.__dict__, _fs=None, _pid=None, _pool=None, _pool_pid=None)

    def pool(self) -> ThreadPoolExecutor:
        """``parallel`` threads for the ranged GETs, shared by all this process's downloads (the
        next file's parts start as one's last arrive; at most ``parallel`` in flight). Remade
        after a fork."""
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.transfer.parallel, thread_name_prefix="packer-get")
                self._pool_pid = os.getpid()
            return self._pool

    def key(self, rel: str) -> str:
        """The store's path of ``rel`` (``NAME``, or ``../part/NAME`` from a merge): '..' may
        climb out of the dataset folder, never out of the bucket."""
        path = posixpath.normpath(posixpath.join(self.root, rel))
        bucket = self.root.split("/", 1)[0]
        if path != bucket and not path.startswith(bucket + "/"):
            raise FormatError(f"{rel!r} in {self.shown} leads out of its bucket; refusing it")
        return path

    def show(self, rel: str) -> str:
        """The URL of ``rel`` as messages show it (credentials redacted)."""
        scheme = self.url.split("://", 1)[0]
        return redact(f"{scheme}://{self.key(rel)}")

    def call(self, fn: Callable, what: str):
        return with_retries(fn, what, self.transfer.retry_seconds, self.secrets)

    def stat(self, rel: str) -> ObjectInfo:
        key = self.key(rel)

        def head():
            self.fs.invalidate_cache(key)
            return self.fs.info(key)
        info = self.call(head, f"looking up {self.show(rel)}")
        if info.get("type") == "directory":
            raise PackerError(f"{self.show(rel)} is a folder, not a file")
        return ObjectInfo(int(info["size"]), version_of(info))

    def listing(self, missing_ok: bool = False) -> Dict[str, ObjectInfo]:
        """Every object directly in the folder, by name: one LIST request (a page per 1,000).
        A missing folder is ``NotFound``, or empty with ``missing_ok``."""
        try:
            entries = self.call(lambda: self.fs.ls(self.root, detail=True, refresh=True),
                                f"listing {self.shown}")
        except NotFound:
            if missing_ok:
                return {}
            raise
        return {posixpath.basename(e["name"].rstrip("/")): ObjectInfo(int(e.get("size") or 0), version_of(e))
                for e in entries if e.get("type") != "directory"}

    def read_bytes(self, rel: str, limit: int = 1 << 30) -> bytes:
        """A whole small object (a manifest): one HEAD, one GET (``get_whole``)."""
        info = self.stat(rel)
        if info.size > limit:
            raise FormatError(f"{self.show(rel)} is {info.size} bytes, more than the {limit} "
                              f"expected; is it the right file?")
        return self.get_whole(rel, info.size)

    def get_whole(self, rel: str, size: int) -> bytes:
        """All of ``rel``, listed or looked up at ``size`` bytes: one GET asking for a byte
        more, so an object longer by now (replaced since, or listed wrong) is ``Grown``, never
        cut to ``size`` (memory stays ``size + 1``); a shorter body is retried."""
        key = self.key(rel)

        def get():
            data = self.fs.cat_file(key, start=0, end=size + 1) if size else b""
            if len(data) > size:
                raise Grown(f"{self.show(rel)} holds more than the {size} bytes it was listed "
                            f"with: it changed since (is it being rewritten?)")
            if len(data) != size:
                raise ShortBody(f"got {len(data)} bytes of {size}")
            return data
        return self.call(get, f"reading {self.show(rel)}")

    def get_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``rel``, retried; a body of another length is retried too."""
        key = self.key(rel)

        def get():
            data = self.fs.cat_file(key, start=start, end=end) if end > start else b""
            if len(data) != end - start:
                raise ShortBody(f"got {len(data)} bytes of {end - start}")
            return data
        return self.call(get, f"reading bytes {start}-{end} of {self.show(rel)}")

    def download(self, rel: str, dest: Path, size: int, sha256: Optional[str] = None,
                 progress: Optional[Callable[[int], None]] = None,
                 expect: Optional[ObjectInfo] = None) -> None:
        """``rel`` into the new file ``dest``: parallel ranged GETs hashed in order, fsynced,
        checked against ``size``/``sha256`` (else the version must not change). On any failure
        ``dest`` is removed and a PackerError says why."""
        try:
            before = expect if expect is not None else self.stat(rel)
            if before.size != size:
                raise FormatError(f"{self.show(rel)} is {before.size} bytes, the manifest says "
                                  f"{size}: the dataset in object storage is damaged or being "
                                  f"rewritten; check it (packer verify on a copy) and rebuild")
            try:
                digest = self._fetch_into(rel, dest, size, progress)
            except PackerError:
                try:
                    change = self._change(rel, before)
                except PackerError:  # the store is unreachable: the first error says it all
                    change = ""
                if change:
                    raise PackerError(change) from None
                raise
            if sha256 is not None and digest == sha256:
                return  # every byte is the manifest's, whatever else happened to the object
            change = self._change(rel, before)
            if change:
                raise PackerError(change)
            if sha256 is not None:
                raise FormatError(f"{self.show(rel)} does not match its manifest entry (SHA-256 "
                                  f"{digest[:12]}... for {sha256[:12]}...): the dataset in object "
                                  f"storage is damaged; rebuild or re-upload it")
        except BaseException:
            Path(dest).unlink(missing_ok=True)
            raise

    def _fetch_into(self, rel: str, dest: Path, size: int, progress) -> str:
        part, window = self.transfer.part_size, self.transfer.parallel
        ranges = [(o, min(size, o + part)) for o in range(0, size, part)]
        h = hashlib.sha256()
        pool, pending = self.pool(), []
        try:
            with open_new(dest) as out:
                pending = [pool.submit(self.get_range, rel, a, b) for a, b in ranges[:window]]
                for i in range(len(ranges)):  # in order: hash and write part i while i+1.. arrive
                    data = pending[i].result()
                    pending[i] = None  # the bytes go as soon as they are written
                    if i + window < len(ranges):
                        pending.append(pool.submit(self.get_range, rel, *ranges[i + window]))
                    h.update(data)
                    out.write(data)
                    if progress is not None:
                        progress(len(data))
                out.flush()
                os.fsync(out.fileno())
        except BaseException:  # parts still queued are dropped, running ones not waited for
            for f in pending:
                if f is not None:
                    f.cancel()
            raise
        return h.hexdigest()

    def _change(self, rel: str, before: ObjectInfo) -> str:
        """What changed in ``rel`` since ``before`` was seen ("" for nothing)."""
        after = self.stat(rel)
        if after == before:
            return ""
        return (f"{self.show(rel)} changed while packer read it (version {before.version} -> "
                f"{after.version}, {before.size} -> {after.size} bytes): is the dataset being "
                f"rewritten? Nothing half-read was kept; re-run when the upload has finished")

    def upload(self, local: Path, rel: str) -> ObjectInfo:
        """Put the finished local file ``local`` at ``rel`` (the client splits a large one into
        parts uploaded in parallel), then check the stored size; returns the object as stored."""
        key, size = self.key(rel), os.path.getsize(local)
        self.call(lambda: self.fs.put_file(os.fspath(local), key),
                  f"uploading {local} to {self.show(rel)}")
        got = self.stat(rel)
        if got.size != size:
            raise PackerError(f"{self.show(rel)} holds {got.size} bytes after uploading {size}; "
                              f"re-run the upload")
        return got


def version_of(info: Dict[str, Any]) -> Optional[str]:
    """What changes when the object does: ETag (S3, Azure), generation (GCS), else mtime."""
    for k in ("ETag", "etag", "generation", "version_id", "VersionId", "md5Hash",
              "LastModified", "last_modified", "mtime", "updated"):
        v = info.get(k)
        if v not in (None, ""):
            return str(v).strip('"')
    return None
