"""Reading shards: global index -> record bytes, with one ``pread`` per record (never an LMDB
memory map: a damaged shard is a ``FormatError``, not a SIGBUS). File descriptors open
lazily, so a reader pickles into workers; a shard replaced since the reader was made (other
device, inode, size or mtime) is a ``FormatError``."""
from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import os
import stat
from array import array
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from ..errors import FormatError
from ..format.manifest import MANIFEST, read_manifest, shard_file
from ..format.records import crc32, unpack_record
from ..format.lmdbfile import shard_records
from ..format.tables import READ_FLAGS, read_offsets


def record_index(index, n: int) -> int:
    """``index`` (negative from the end, as for a list) as a position in ``0..n-1``; an
    IndexError naming the index given, a TypeError for what is not an integer."""
    try:
        i = index.__index__()
    except AttributeError:
        raise TypeError(f"record indices must be integers, not {type(index).__name__}") from None
    if not -n <= i < n:
        raise IndexError(f"record {i} out of range for a dataset of {n}")
    return i + n if i < 0 else i


class ShardReader:
    """Random access to the records of a dataset (all its shards); ``verify_crc`` checks each
    record's CRC-32 as it is read."""

    def __init__(self, root: os.PathLike, manifest: Optional[dict] = None, *,
                 verify_crc: bool = False, cache=None):
        self.cache = cache  # a packer.storage.ShardCache: shards fetched on first use, pinned while open
        if cache is not None:
            root, manifest = cache.root, cache.manifest
        self.root = Path(root)
        self.manifest = manifest if manifest is not None else read_manifest(self.root)
        self.verify_crc = bool(verify_crc)
        self.build_id = self.manifest.get("build_id")
        shards = self.manifest["shards"]
        self.paths = [shard_file(self.root, s["path"]) for s in shards]
        self.starts = [0, *itertools.accumulate(s["count"] for s in shards)]  # per shard
        self.identity = [None if cache else _identity(p, s, self.root)
                         for p, s in zip(self.paths, shards)]
        self.offsets = read_offsets(self.root, self.manifest)  # (offset, length) pairs
        if self.offsets is None:  # older datasets: read each shard's tree once, here
            self.offsets = array("Q")
            for k, p in enumerate(self.paths):
                self.offsets.extend(shard_records(cache.shard_path(k, pin=False) if cache else p))
        self._pid: Optional[int] = None
        self._fds: List[Optional[int]] = []
        self._order: List[int] = []  # shards open from the cache, oldest first

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> Tuple[int, int]:
        """Global index -> (shard number, key within shard)."""
        index = record_index(index, len(self))
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # first use in this process (or we were forked): reopen
            self._fds, self._pid, self._order = [None] * len(self.paths), os.getpid(), []
        fd = self._fds[shard]
        if fd is None:
            if self.cache is not None:
                self._cached(shard)
            try:
                fd = self._open(shard)
            except BaseException:
                if self.cache is not None:  # not open: its pin goes (it is not in _order)
                    self.cache.release(shard)
                raise
            self._fds[shard] = fd
            if self.cache is not None:
                self._order.append(shard)
        return fd

    def _open(self, shard: int) -> int:
        try:
            fd = os.open(self.paths[shard], READ_FLAGS | os.O_NONBLOCK)  # a FIFO put in its
            # place must not wait for a writer: the identity check below refuses it
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise FormatError(f"{self.paths[shard]} cannot be opened: too many open files "
                                  f"(raise the limit: ulimit -n)") from None
            raise FormatError(
                f"{self.paths[shard]} cannot be opened ({e.strerror}): it was removed or "
                f"made unreadable after this dataset was opened (unstaged?); stage or open "
                f"the dataset again") from None
        st = os.fstat(fd)
        if self.cache is not None and st.st_size == self.manifest["shards"][shard]["bytes"]:
            self.identity[shard] = _stat_identity(st)  # named by its SHA-256: any copy is it
        if _stat_identity(st) != self.identity[shard]:
            os.close(fd)
            raise FormatError(
                f"{self.paths[shard]} was replaced after this dataset was opened (re-staged "
                f"or rebuilt in place?): its records no longer match the offsets and labels "
                f"read then. Open the dataset again (a new PackedDataset) to read the new files")
        return fd

    def read(self, index: int) -> bytes:
        """The raw msgpack record at global ``index``."""
        shard, local = self.locate(index)
        i = 2 * (self.starts[shard] + local)
        offset, length = self.offsets[i], self.offsets[i + 1]
        fd = self._fd(shard)
        if offset + length > self.identity[shard][2]:  # the table from a stranger: never trusted
            raise FormatError(f"record {index}: offsets.u64 points past the end of "
                              f"{self.paths[shard].name} (a damaged or crafted table); run "
                              f"`packer verify {self.root}`")
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise FormatError(f"{self.paths[shard]} is shorter than its offsets say; damaged shard")
        return data

    def record(self, index: int) -> dict:
        rec = unpack_record(self.read(index))
        if self.verify_crc and crc32(rec["image"]) != rec.get("crc32"):
            raise FormatError(f"record {index} of {self.root}: its image fails its CRC-32 check "
                              f"(damaged storage?); run `packer verify {self.root}`")
        return rec

    def _cached(self, shard: int) -> None:
        """Unpin and close the oldest cached shards beyond one (none without ``cache_limit``:
        nothing is evicted, so reopening would only cost a lock); fetch and pin ``shard``."""
        keep = 2 if self.cache.limit is not None else len(self.paths) + 1
        while len(self._order) >= keep:
            k = self._order.pop(0)
            os.close(self._fds[k])
            self._fds[k] = None
            self.cache.release(k)
        self.cache.shard_path(shard)  # pinned; listed in _order once it is open

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds:
                if fd is not None:
                    os.close(fd)
            if self.cache is not None:
                self.cache.close()
        self._fds, self._pid, self._order = [], None, []

    def __getstate__(self):
        return {**self.__dict__, "_fds": [], "_pid": None, "_order": []}  # fds stay in this process

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def _stat_identity(st: os.stat_result) -> Tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _identity(path: Path, entry: dict, root: Path) -> Tuple[int, int, int, int]:
    """The shard file as found now, checked against its manifest entry: a regular file of the
    size the manifest says (a merge's part folders must be packer datasets themselves)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FormatError(f"shard {path} listed in {root / MANIFEST} is missing; re-stage or "
                          f"rebuild the dataset") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"shard {path} is not a regular file")
    if st.st_size != entry["bytes"]:
        raise FormatError(f"shard {path} is {st.st_size} bytes but {root / MANIFEST} says "
                          f"{entry['bytes']} (an incomplete copy?); re-stage or rebuild the dataset")
    return _stat_identity(st)


@contextlib.contextmanager
def open_reader(root, storage_options: Optional[dict] = None,
                cache_dir: Optional[os.PathLike] = None) -> Iterator[ShardReader]:
    """A ``ShardReader`` of the dataset at a path or URL, closed afterwards; a URL's shards
    are fetched on first use into ``cache_dir`` (``packer.storage.local.cache_for``)."""
    from ..storage.local import cache_for, is_url
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(cache_for(root, storage_options, cache_dir)) if is_url(root) else None
        reader = ShardReader(root, cache=cache)
        stack.callback(reader.close)
        yield reader
