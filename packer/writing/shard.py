"""Writing a dataset's files: one shard (``.NAME.partial`` while written, then compacted,
fsynced, hashed and renamed into place), and the per-record side tables."""
from __future__ import annotations

import contextlib
import os
from array import array
from pathlib import Path
from typing import List, Optional, Tuple

import lmdb

from .._util.system import disk_full_as
from .._util.fsio import fsync_dir, open_new, write_new_atomic
from ..errors import PackerError
from ..format.fields import little_endian
from ..format.manifest import file_sha256
from ..format.records import key

TXN_BYTES = 64 << 20   # one commit per ~64 MiB: few fsync-free commits, bounded RAM
MIN_MAP = 64 << 20


class ShardWriter:
    """Append-only writer for one shard file."""

    def __init__(self, path: os.PathLike, *, expected_bytes: int):
        self.path = Path(path)
        self.partial = self.path.with_name("." + self.path.name + ".partial")
        self.compact = self.path.with_name("." + self.path.name + ".compact")
        self.map_size = max(MIN_MAP, int(expected_bytes * 1.25))
        self.env = None
        with disk_errors(self.path):
            open_new(self.partial).close()  # LMDB then opens this new file, not a planted link
            try:  # a full disk can fail the open itself: then no caller holds us to abort()
                # meminit: pages zeroed, never stale heap bytes (same shard each build, no leak)
                self.env = lmdb.open(str(self.partial), subdir=False, map_size=self.map_size,
                                     sync=False, metasync=False, readahead=False, max_dbs=0,
                                     lock=False, meminit=True)
            except BaseException:
                self.partial.unlink(missing_ok=True)
                raise
        self.count = 0
        self.bytes = 0  # record bytes appended (payload, not file size)
        self._pending: List[Tuple[bytes, bytes]] = []
        self._pending_bytes = 0

    def append(self, record: bytes) -> None:
        self._pending.append((key(self.count), record))
        self.count += 1
        self.bytes += len(record)
        self._pending_bytes += len(record)
        if self._pending_bytes >= TXN_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        while True:
            try:
                with disk_errors(self.path), self.env.begin(write=True) as txn:
                    _, added = txn.cursor().putmulti(self._pending, append=True)
                    assert added == len(self._pending), "keys must be new and increasing"
                break
            except lmdb.MapFullError:  # only address space: grow it, redo the rolled-back commit
                self.map_size *= 2
                self.env.set_mapsize(self.map_size)
        self._pending.clear()
        self._pending_bytes = 0

    def finish(self) -> dict:
        """Compact into the final file; returns the manifest's shard entry."""
        self.flush()
        with disk_errors(self.path):
            with open_new(self.compact) as f:
                self.env.copyfd(f.fileno(), compact=True)
                f.flush()
                os.fsync(f.fileno())
        self.close()
        self.partial.unlink(missing_ok=True)
        digest = file_sha256(self.compact)
        size = self.compact.stat().st_size
        os.replace(self.compact, self.path)
        fsync_dir(self.path.parent)
        return {"path": self.path.name, "count": self.count, "bytes": size, "sha256": digest}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def abort(self) -> None:
        self.close()
        for p in (self.partial, self.compact):
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def disk_errors(path: Path):
    """Turn a full disk, or this process's file-size limit, met while writing ``path`` into a
    PackerError that says what was kept and what to do."""
    try:
        with disk_full_as(path, lambda free: (
                f"disk full while writing {path} ({free / 2**20:.1f} MiB free). Shards finished "
                f"before this one are kept; free some space (or pick another DST) and re-run the "
                f"same command to resume"), types=(OSError, lmdb.Error)):  # lmdb: only in words
            yield
    except lmdb.Error as e:  # a commit cut short by ``ulimit -f`` is an EIO with room on disk
        limit = file_size_limit()
        if limit is None or "input/output error" not in str(e).lower():
            raise
        raise PackerError(f"writing {path} failed ({e}) under a file size limit of {limit:,} "
                          f"bytes (ulimit -f), below a shard's size. Shards finished before "
                          f"this one are kept; raise the limit (ulimit -f unlimited) and re-run "
                          f"the same command to resume") from e


def file_size_limit() -> Optional[int]:
    """This process's ``RLIMIT_FSIZE`` in bytes, or None if unlimited (or no such limit)."""
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def existing_shard_ok(entry: dict, root: Path) -> Optional[str]:
    """None if ``root/entry['path']`` matches its manifest entry, else what is wrong."""
    p = root / entry["path"]
    if not p.is_file():
        return "missing"
    size = p.stat().st_size
    if size != entry["bytes"]:
        return f"size {size} != {entry['bytes']}"
    return "checksum mismatch" if file_sha256(p) != entry["sha256"] else None


def write_table(dst: Path, name: str, table) -> dict:
    """Write a per-record table (an array, little-endian, or bytes) atomically; its entry."""
    if isinstance(table, array):
        table = little_endian(table).tobytes()
    with disk_errors(dst / name):
        write_new_atomic(dst / name, bytes(table))
    return {"path": name, "bytes": (dst / name).stat().st_size, "sha256": file_sha256(dst / name)}
