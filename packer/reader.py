"""Reading shards: global index -> record bytes, one lazily opened set of envs per process.

LMDB environments must never cross a fork (their locks and maps are per process), so the
reader opens them on first use in whichever process reads, and pickles without them.

Each record is fetched with one ``pread`` at the byte range that ``offsets.u64`` (written
at build time) gives, not through LMDB's map: py-lmdb touches every page of a value it
returns, and with ``readahead=False`` (right for random access, or the page cache fills
with neighbours never read) each touch is one 4 KiB disk read — ~17 I/Os for a 70 KB JPEG,
measured 0.07x the image folder's speed on a throttled disk (docs/benchmarks.md). The pread is one I/O,
and sequential preads get the kernel's per-file readahead for free. Datasets without the
offsets table (built off Linux) are read through LMDB.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import sys
from array import array
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import lmdb

from .errors import FormatError
from .format import LABELS, OFFSETS, key, read_manifest, unpack_record


class ShardReader:
    """Random access to the records of a dataset (all its shards)."""

    def __init__(self, root: os.PathLike, manifest: Optional[dict] = None):
        self.root = Path(root)
        self.manifest = manifest if manifest is not None else read_manifest(self.root)
        self.paths = [self.root / s["path"] for s in self.manifest["shards"]]
        # Cumulative counts per *shard* (a handful of ints): index maths without per-sample lists.
        self.starts = [0]
        for s in self.manifest["shards"]:
            self.starts.append(self.starts[-1] + s["count"])
        for p, s in zip(self.paths, self.manifest["shards"]):
            if not p.is_file():
                raise FormatError(f"shard {p} listed in {self.root / 'manifest.json'} is missing; "
                                  f"re-stage or rebuild the dataset")
            size = p.stat().st_size
            if size != s["bytes"]:  # a short file would be mapped and read past its end: SIGBUS
                raise FormatError(f"shard {p} is {size} bytes but {self.root / 'manifest.json'} says "
                                  f"{s['bytes']} (an incomplete copy?); re-stage or rebuild the dataset")
        self.offsets = read_offsets(self.root, self.manifest)  # (offset, length) pairs, or None
        self._pid: Optional[int] = None
        self._open: List[Optional[_Shard]] = []

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> Tuple[int, int]:
        """Global index -> (shard number, key within shard)."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"record {index} out of range for a dataset of {n}")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def _shard(self, shard: int) -> "_Shard":
        if self._pid != os.getpid():  # first use in this process (or we were forked): reopen
            self._open, self._pid = [None] * len(self.paths), os.getpid()
        if self._open[shard] is None:
            self._open[shard] = _Shard.get(self.paths[shard])
        return self._open[shard]

    def read(self, index: int) -> bytes:
        """The raw msgpack record at global ``index``."""
        shard, local = self.locate(index)
        sh = self._shard(shard)
        if self.offsets is not None:
            i = 2 * (self.starts[shard] + local)
            offset, length = self.offsets[i], self.offsets[i + 1]
            data = os.pread(sh.fd, length, offset)
            if len(data) != length:
                raise FormatError(f"{self.paths[shard]} is shorter than its offsets say; damaged shard")
            return data
        view = sh.lookup(local)
        if view is None:
            raise FormatError(f"{self.paths[shard]} has no record {local}; the shard is damaged "
                              f"(run `packer verify {self.root}`)")
        if sh.base is None:  # no /proc/self/maps (not Linux): copy through the map
            return bytes(view)
        data = os.pread(sh.fd, len(view), _address(view) - sh.base)
        if len(data) != len(view):
            raise FormatError(f"{self.paths[shard]} is shorter than its index says; damaged shard")
        return data

    def record(self, index: int) -> dict:
        return unpack_record(self.read(index))

    def close(self) -> None:
        if self._pid == os.getpid():
            for sh in self._open:
                if sh is not None:
                    sh.release()
        self._open, self._pid = [], None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_open"], state["_pid"] = [], None  # never pickle an open environment
        return state

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Shard:
    """One open shard, shared by every reader of that file in this process.

    py-lmdb refuses to open one file twice in a process, so two datasets over the same
    shards (train and val views, say) must share the environment; a refcount closes it.
    Entries are keyed by pid as well, so a forked child never touches its parent's.
    """
    _cache: Dict[Tuple[int, int, int], "_Shard"] = {}

    def __init__(self, path: Path, ident):
        self.ident, self.refs, self.path = ident, 0, path
        self.fd = os.open(path, os.O_RDONLY)
        self.env = self.txn = self.base = None

    def lmdb(self) -> lmdb.Environment:
        """The shard's environment, opened on first need (reads with offsets never need it)."""
        if self.env is None:
            self.env = open_env(self.path)
            self.txn = self.env.begin(buffers=True)  # one long read txn: the data never changes
            self.base = _map_base(self.fd)
        return self.env

    def lookup(self, local: int) -> Optional[memoryview]:
        """The value at ``local`` through LMDB (only for datasets without an offsets table)."""
        self.lmdb()
        return self.txn.get(key(local))

    @classmethod
    def get(cls, path: Path) -> "_Shard":
        pid = os.getpid()
        if any(k[0] != pid for k in cls._cache):
            cls._drop_inherited(pid)
        st = os.stat(path)
        ident = (pid, st.st_dev, st.st_ino)
        sh = cls._cache.get(ident)
        if sh is None:
            sh = cls._cache[ident] = cls(path, ident)
        sh.refs += 1
        return sh

    @classmethod
    def _drop_inherited(cls, pid: int) -> None:
        """In a forked child, close this process's copies of the parent's environments.

        py-lmdb's "already open in this process" registry survives fork, so the child could
        not open those shards again; and the inherited mapping of the same file would also
        confuse ``_map_base``. Closing the copies here leaves the parent's untouched.
        """
        for ident in [k for k in cls._cache if k[0] != pid]:
            sh = cls._cache.pop(ident)
            try:
                if sh.env is not None:
                    sh.env.close()  # also ends its read transaction
            except Exception:
                pass
            try:
                st = os.fstat(sh.fd)
                if (st.st_dev, st.st_ino) == ident[1:]:  # still the inherited descriptor
                    os.close(sh.fd)
            except OSError:
                pass

    def release(self) -> None:
        self.refs -= 1
        if self.refs <= 0 and self._cache.pop(self.ident, None) is not None:
            if self.env is not None:
                self.txn.abort()
                self.env.close()
            os.close(self.fd)


def shard_entry_count(path: os.PathLike) -> int:
    """How many records the LMDB file at ``path`` holds (raises ``lmdb.Error`` if it is not
    one). Shares the process's open environment of that file, if any: py-lmdb refuses a
    second one."""
    sh = _Shard.get(Path(path))
    try:
        return sh.lmdb().stat()["entries"]
    finally:
        sh.release()


def open_env(path: os.PathLike) -> lmdb.Environment:
    """A shard's LMDB environment, read-only, with no lock file and no readahead."""
    return lmdb.open(str(path), subdir=False, readonly=True, lock=False, readahead=False,
                     meminit=False, max_readers=1, max_spare_txns=0)


def shard_offsets(path: os.PathLike) -> Optional[array]:
    """(offset, length) of every value of a finished shard, in key order; None off Linux.

    Reads the whole shard (py-lmdb touches every value), which is why the build does it once
    while the file is still in the page cache, and readers never do.
    """
    env = open_env(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with env.begin(buffers=True) as txn:
            base = None
            out = array("Q")
            for n, (k, v) in enumerate(txn.cursor()):
                if base is None:
                    base = _map_base(fd)
                    if base is None:
                        return None
                if bytes(k) != key(n):
                    raise FormatError(f"{path}: keys are not 0..N-1 in order (found {bytes(k).hex()} at {n})")
                out.append(_address(v) - base)
                out.append(len(v))
            return out
    finally:
        os.close(fd)
        env.close()


def _map_base(fd: int) -> Optional[int]:
    """Start address of this process's mapping of the file open as ``fd`` (Linux), else None.

    py-lmdb reports ``map_addr`` only for fixed maps, so find it in /proc/self/maps by inode.
    """
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                fields = line.split(None, 5)
                if (len(fields) >= 5 and int(fields[4]) == st.st_ino and int(fields[2], 16) == 0
                        and fields[3].decode() == dev):
                    return int(fields[0].split(b"-")[0], 16)
    except OSError:
        pass
    return None


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def _address(view: memoryview) -> int:
    """Address of a read-only buffer's first byte, without reading (faulting) its pages."""
    buf = _PyBuffer()
    _get_buffer(view, ctypes.byref(buf), 0)
    try:
        return buf.buf
    finally:
        _release_buffer(ctypes.byref(buf))


def read_labels(root: os.PathLike, manifest: Optional[dict] = None) -> array:
    """All labels in record order, as one compact int32 array (no per-sample objects)."""
    manifest = manifest if manifest is not None else read_manifest(root)
    return _read_table(Path(root), manifest, "labels", LABELS, "i", 1)


def read_offsets(root: os.PathLike, manifest: Optional[dict] = None) -> Optional[array]:
    """Every record's (offset in its shard, length), flattened; None if the dataset has none."""
    manifest = manifest if manifest is not None else read_manifest(root)
    if "offsets" not in manifest:
        return None
    return _read_table(Path(root), manifest, "offsets", OFFSETS, "Q", 2)


def _read_table(root: Path, manifest: dict, name: str, default: str, typecode: str, per_record: int) -> array:
    path = root / manifest.get(name, {}).get("path", default)
    table = array(typecode)
    try:
        with open(path, "rb") as f:
            table.frombytes(f.read())
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: cannot read {name} ({getattr(e, 'strerror', None) or e}); "
                          f"re-stage or rebuild") from None
    if sys.byteorder != "little":
        table.byteswap()
    if len(table) != per_record * manifest["count"]:
        raise FormatError(f"{path} holds {len(table) // per_record} {name} for {manifest['count']} "
                          f"records; the dataset is damaged")
    return table
