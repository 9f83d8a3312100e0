"""Copying one dataset file for ``stage``: whole, to a temporary name, hashing on the way,
checked against the manifest and renamed into place. A full disk becomes a PackerError saying
how to resume. The copy is not read back: right after writing, a read comes from the page
cache, so a second hash would check memory against memory."""
from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from .._util.fsio import open_new
from .._util.system import disk_full_as, human_size
from ..errors import FormatError
from ..format.manifest import HASH_CHUNK

TMP_SUFFIX = ".staging"


@dataclass
class StagedFile:
    """One file of the dataset to stage: its flat name in TARGET and where it is now (a
    ``packer.storage.remote.RemoteFile`` for a dataset in object storage)."""
    name: str
    src: Path
    bytes: int
    sha256: Optional[str]
    kind: str                 # "shard", "labels" or "offsets"


def tmpfs_advice(need: Optional[int] = None) -> str:
    """How to make a RAM filesystem big enough (``need`` bytes, if known)."""
    size = f"{max(1, math.ceil(need * 1.05 / 2**30))}G" if need else "SIZE"
    return f"sudo mount -t tmpfs -o size={size} tmpfs MOUNTPOINT"


def copy_file(f: StagedFile, target: Path, progress) -> None:
    """Copy ``f`` whole to a temporary name in TARGET, check it, rename it to ``f.name``."""
    tmp = target / ("." + f.name + TMP_SUFFIX)
    with disk_full(target / f.name):
        if isinstance(f.src, Path):
            _copy_local(f, tmp, progress)
        else:  # in object storage: fetched and verified by packer.storage
            f.src.download(tmp, f.bytes, f.sha256, progress)
    os.replace(tmp, target / f.name)


def _copy_local(f: StagedFile, tmp: Path, progress) -> None:
    """``f`` into ``tmp``, checked; chunk i is hashed in a second thread while it is written
    and i+1 read (hashlib and file I/O release the GIL)."""
    h = hashlib.sha256()
    size = 0
    try:
        with ThreadPoolExecutor(1) as hasher, open(f.src, "rb", buffering=0) as src, \
                open_new(tmp) as out:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            pending: List[Future] = []
            # a new buffer each time (no readinto): the hasher may still hold the last one
            for chunk in iter(lambda: src.read(HASH_CHUNK), b""):
                pending.append(hasher.submit(h.update, chunk))  # one worker: in order
                out.write(chunk)  # a BufferedWriter: writes it all or raises
                size += len(chunk)
                progress(len(chunk))
                if len(pending) > 2:  # bound the memory held by chunks waiting to be hashed
                    pending.pop(0).result()
            for fut in pending:
                fut.result()
            out.flush()
            os.fsync(out.fileno())
        if size != f.bytes or (f.sha256 is not None and h.hexdigest() != f.sha256):
            raise FormatError(f"{f.src} does not match its manifest entry (size {size} for "
                              f"{f.bytes}, or a checksum mismatch): the source dataset is damaged; "
                              f"run `packer verify` on it, and rebuild it")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def disk_full(path: Path):
    """A full disk while staging ``path`` -> a PackerError that says what to do."""
    return disk_full_as(path, lambda free: (
        f"{path.parent} filled up while staging {path.name} ({human_size(free)} free). Make "
        f"room (a bigger tmpfs: {tmpfs_advice()}) and re-run the same command"))
