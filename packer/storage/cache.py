"""A node-local cache of a remote dataset's shards, for reading without staging: the node's
processes share ``cache_dir/<name>-<hash of the URL>/``; a file is written under an exclusive
``flock``, verified and renamed into place; shards in use are pinned (shared ``flock``)
against LRU eviction (docs/object_storage.md)."""
from __future__ import annotations

try:
    import fcntl
except ImportError:  # Windows: a ShardCache says so when made; importing this works
    fcntl = None

import contextlib
import hashlib
import json
import os
import re
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from copy import deepcopy
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

from .._util.fsio import lock_module, write_json_atomic
from .._util.system import disk_full_as, human_size
from ..errors import PackerError
from ..format.manifest import MANIFEST, set_table, side_tables
from .objects import Store
from .remote import check_parts, fetch_manifest

LOCKS = ".locks"
OPEN_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


HELD: set = set()  # lock descriptors open in this process now (fetch, evict, pin)
FORKING = threading.Lock()  # held while a descriptor opens or closes, and across a fork


def _drop_inherited() -> None:
    """In a forked child: close the parent's lock descriptors (an inherited ``flock`` would
    hold the parent's fetch lock for the child's life: the next fetch would wait forever)."""
    global FORKING
    for fd in list(HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    HELD.clear()
    FORKING = threading.Lock()  # the parent's is held (the fork happened inside it)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: FORKING.acquire(), after_in_parent=lambda: FORKING.release(),
                        after_in_child=_drop_inherited)


def parse_size(value: Union[int, str, None]) -> Optional[int]:
    """``None``, a byte count, or text such as ``"200G"`` / ``"1.5T"`` (powers of 1024);
    anything else (``"1.2.3"``, a negative count, ``True``) is a PackerError, not a ValueError."""
    if value is None or isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([KMGT]?)I?B?\s*", str(value).upper())
    if isinstance(value, bool) or not m:
        raise PackerError(f"cache_limit={value!r} is not a size (examples: 200G, 1.5T, 10**12)")
    return int(float(m.group(1)) * UNITS[m.group(2)])


class ShardCache:
    """Shards of the dataset at ``url`` on this node's disk, fetched on first use: ``shard_path(k)``
    before opening shard ``k``; ``manifest`` names files in ``root``. ``cache_limit`` (bytes or
    ``"200G"``; None: unbounded) must hold the shards the node's processes read at once."""

    def __init__(self, url: str, cache_dir: os.PathLike, cache_limit: Union[int, str, None] = None,
                 storage_options: Optional[Dict[str, Any]] = None, *, prefetch_workers: int = 2):
        lock_module()  # no fcntl (Windows): one PackerError saying so
        self.store = Store(url, storage_options)
        self.limit = parse_size(cache_limit)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.store.shown.split("://", 1)[-1])[-60:].strip("-.")
        self.root = Path(cache_dir) / f"{slug}-{hashlib.sha256(self.store.shown.encode()).hexdigest()[:12]}"
        (self.root / LOCKS).mkdir(parents=True, exist_ok=True)
        remote = fetch_manifest(self.store)
        check_parts(self.store, (s["path"] for s in remote["shards"]), set())
        self.manifest = deepcopy(remote)
        self._entries = [(_content_name(s, remote, "lmdb"), s["path"], s["bytes"], s.get("sha256"))
                         for s in remote["shards"]]  # (local name, remote path, bytes, sha256)
        self.manifest["shards"] = [dict(s, path=e[0]) for s, e in zip(remote["shards"], self._entries)]
        self.manifest["cached"] = {"from": self.store.shown}
        biggest = max((s["bytes"] for s in remote["shards"]), default=0)
        if self.limit is not None and biggest > self.limit:
            raise PackerError(f"cache_limit ({human_size(self.limit)}) is smaller than one shard "
                              f"of {self.store.shown} ({human_size(biggest)}); raise it")
        self.prefetch_workers = max(1, prefetch_workers)
        self._reset()
        self.clean_leftovers()
        self.downloads = self.downloaded_bytes = self.hits = self.evictions = 0
        for key, entry, staged_name in side_tables(remote):
            name = _content_name(entry, remote, staged_name)
            self._ensure(name, entry["path"], entry["bytes"], entry.get("sha256"), pin=False)
            set_table(self.manifest, key, dict(entry, path=name))
        self.downloads = self.downloaded_bytes = self.hits = self.evictions = 0  # shards only

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._pins: Dict[int, int] = {}  # shard -> fd holding a shared lock
        self._mutex = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_pins", "_mutex", "_pool", "_pid")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def _here(self) -> None:  # after a fork the parent's pins and threads are not ours
        if self._pid != os.getpid():
            self._reset()

    def shard_path(self, k: int, *, pin: bool = True) -> Path:
        """The local path of shard ``k``, downloaded (once per node) if it is not here yet.
        With ``pin`` it is not evicted until ``release(k)``."""
        self._here()
        name, rel, size, sha = self._entries[k]
        with self._mutex:
            if k in self._pins:
                _touch(self.root / name)
                self.hits += 1
                return self.root / name
        fd = self._ensure(name, rel, size, sha, pin=pin)
        if fd is not None:
            with self._mutex:
                if self._pins.setdefault(k, fd) != fd:  # pinned meanwhile by another thread
                    _close_lock(fd)
        return self.root / name

    def release(self, k: int) -> None:
        """Unpin shard ``k`` (it may be evicted from now on)."""
        self._here()
        with self._mutex:
            fd = self._pins.pop(k, None)
        if fd is not None:
            _close_lock(fd)

    def prefetch(self, shards: Iterable[int]) -> List[Future]:
        """Fetch these shards in the background (``prefetch_workers`` at a time), unpinned;
        the futures raise what a failed fetch raised (a later ``shard_path`` retries)."""
        self._here()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.prefetch_workers, thread_name_prefix="packer-cache")
        return [self._pool.submit(self.shard_path, k, pin=False) for k in shards]

    def close(self) -> None:
        """Stop prefetching and drop this process's pins."""
        self._here()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for k in list(self._pins):
            self.release(k)

    def write_manifest(self) -> Path:
        """``root/manifest.json``, making ``root`` a dataset folder once every shard is here;
        written by one process at a time (runs may share a ``cache_dir``), kept if the same."""
        path = self.root / MANIFEST
        with self._locked(MANIFEST, "write", fcntl.LOCK_EX):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(path.read_bytes()) == self.manifest:
                    return path
            write_json_atomic(path, self.manifest)
        return path

    def __len__(self) -> int:
        return len(self._entries)

    def _lock(self, name: str, kind: str) -> int:
        with FORKING:  # no fork between the open and the record: the child closes its copy
            fd = os.open(self.root / LOCKS / f"{name}.{kind}", OPEN_FLAGS, 0o644)
            HELD.add(fd)
        return fd

    @contextlib.contextmanager
    def _locked(self, name: str, kind: str, how: int):
        """Hold ``flock(how)`` on NAME's ``kind`` lock (``LOCK_NB``: BlockingIOError if taken)."""
        fd = self._lock(name, kind)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            _close_lock(fd)

    def _ensure(self, name: str, rel: str, size: int, sha: Optional[str], pin: bool) -> Optional[int]:
        """Make ``root/name`` present; with ``pin``, return the fd holding its pin (shared)."""
        path, fetched = self.root / name, False
        while True:
            if _size(path) == size:
                fd = self._lock(name, "pin") if pin else None
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                if _size(path) == size:  # not evicted between the look and the pin
                    _touch(path)
                    self.hits += not fetched
                    return fd
                if fd is not None:
                    _close_lock(fd)
            with self._locked(name, "fetch", fcntl.LOCK_EX):  # one writer: waits for another's
                if _size(path) != size:
                    self._fetch(name, rel, size, sha)
                    fetched = True

    def _fetch(self, name: str, rel: str, size: int, sha: Optional[str]) -> None:
        """Download ``rel`` to ``name``; the caller holds NAME's fetch lock."""
        for p in self.root.glob(f".{name}.*.part"):  # a killed process's (we hold the lock)
            p.unlink(missing_ok=True)
        if name.endswith(".lmdb"):
            self._make_room(size)
        tmp = self.root / f".{name}.{os.getpid()}-{threading.get_ident()}.part"
        with disk_full_as(tmp, lambda free: (
                f"{self.root} filled up while caching {self.store.show(rel)} ({human_size(size)}; "
                f"{human_size(free)} free): make room there, or give another cache_dir (or a "
                f"lower cache_limit), and re-run")):
            self.store.download(rel, tmp, size, sha)
        os.replace(tmp, self.root / name)
        self.downloads += 1
        self.downloaded_bytes += size

    def _make_room(self, need: int) -> None:
        """Evict least recently used, unpinned shards until ``need`` more bytes fit."""
        if self.limit is None:
            return
        with self._locked("", "evict", fcntl.LOCK_EX):  # one evicting process at a time
            files = [(st.st_atime_ns, e.name, st.st_size) for e in os.scandir(self.root)
                     if e.name.endswith((".lmdb", ".part")) for st in [_stat(e)] if st is not None]
            used = sum(size for _, _, size in files)
            for _, name, size in sorted(f for f in files if not f[1].startswith(".")):
                if used + need <= self.limit:
                    return
                if self._evict(name):
                    used -= size
            if used + need > self.limit:
                warnings.warn(f"the shards in use in {self.root} ({human_size(used)}) and the next "
                              f"({human_size(need)}) exceed cache_limit ({human_size(self.limit)}): "
                              f"raise it, or read with fewer processes per node", RuntimeWarning)

    def _evict(self, name: str) -> bool:
        """Remove shard ``name`` unless some process pins it."""
        try:
            with self._locked(name, "pin", fcntl.LOCK_EX | fcntl.LOCK_NB):
                (self.root / name).unlink(missing_ok=True)
        except BlockingIOError:
            return False
        self.evictions += 1
        return True

    def clean_leftovers(self) -> int:
        """Remove ``.part`` files no live process is writing (a crash's); returns how many."""
        removed = 0
        for p in self.root.glob(".*.part"):
            name = p.name[1:].rsplit(".", 2)[0]  # .NAME.PID-TID.part
            with contextlib.suppress(BlockingIOError):  # being written now
                with self._locked(name, "fetch", fcntl.LOCK_EX | fcntl.LOCK_NB):
                    p.unlink(missing_ok=True)
                    removed += 1
        return removed

    def usage(self) -> int:
        """Bytes of shards in the cache now (all processes')."""
        return sum(st.st_size for e in os.scandir(self.root) if e.name.endswith(".lmdb")
                   for st in [_stat(e)] if st is not None)


def _close_lock(fd: int) -> None:
    with FORKING:
        HELD.discard(fd)  # first: once closed, the number may be another thread's new file
        os.close(fd)


def _content_name(entry: dict, manifest: dict, suffix: str) -> str:
    """A file's name in the cache, from its content: its SHA-256 (else what identifies it)."""
    key = entry.get("sha256") or hashlib.sha256(
        f"{manifest.get('build_id')}/{entry['path']}/{entry['bytes']}".encode()).hexdigest()
    return f"{key[:32]}.{suffix}" if "." not in suffix else f"{key[:32]}-{suffix}"


def _stat(path: Union[Path, os.DirEntry]) -> Optional[os.stat_result]:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _size(path: Path) -> Optional[int]:
    st = _stat(path)
    return None if st is None else st.st_size


def _touch(path: Path) -> None:
    """Mark ``path`` used now: atime is the LRU clock (mtime, which readers check, stays)."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
