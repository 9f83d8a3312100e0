"""Make reads come from the device: ``drop_page_cache`` evicts files (as root, everything);
``storage`` names the filesystem and disk holding a path (for the report). The slow-disk
throttle of the repository's benchmarks builds on these (``benchmarks/benchlib/slowdisk.py``)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional, Sequence, Tuple

from .._util.system import fs_type


def drop_page_cache(paths: Sequence[os.PathLike] = (), everything: bool = True) -> str:
    """Evict ``paths`` from the page cache so the next read comes from the device: as root (with
    ``everything``) drop_caches, else ``POSIX_FADV_DONTNEED`` per file. Returns how."""
    if everything and hasattr(os, "geteuid") and os.geteuid() == 0:
        with contextlib.suppress(OSError):  # root in a container: /proc/sys is read-only
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "cold (drop_caches)"
    if hasattr(os, "posix_fadvise"):
        os.sync()  # pages of files just written are dirty: DONTNEED would keep them
        ok = False
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                ok = True
            except OSError:
                pass
            finally:
                os.close(fd)
        if ok:
            return "cold (fadvise DONTNEED)"
    return "warm cache (could not drop it)"


def block_disk(path: os.PathLike) -> Tuple[str, Optional[Path]]:
    """MAJ:MIN of the device holding ``path``, and the sysfs folder of its whole disk (the
    disk, not a partition; None for overlayfs, tmpfs, NFS...: no block device)."""
    st = os.stat(path)
    majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / majmin
    if not sys_dev.exists():
        return majmin, None
    real = sys_dev.resolve()
    return majmin, real.parent if (real / "partition").exists() else real


def storage(path: os.PathLike) -> str:
    """Filesystem type and, for block devices, sysfs's rotational flag (1 = HDD, or unknown
    to a virtual disk), e.g. ``"ext4 on vda, rotational"`` or ``"tmpfs (RAM)"``."""
    fs = fs_type(path) or "?"
    if fs in ("tmpfs", "ramfs"):
        return f"{fs} (RAM)"
    with contextlib.suppress(OSError, ValueError):
        _, disk = block_disk(path)
        flag = disk / "queue" / "rotational" if disk is not None else None
        if flag is not None and flag.exists():
            rot = flag.read_text().strip() == "1"
            return f"{fs} on {disk.name}, {'rotational' if rot else 'non-rotational'}"
    return fs
