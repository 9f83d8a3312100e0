"""A slow disk for the benchmarks: ``SlowDisk(path)`` is a block-I/O cgroup throttling reads
from the disk holding ``path`` like a modest network or cloud disk (400 read IOPS, 100 MiB/s):
cgroup v1 ``blkio.throttle.read_{iops,bps}_device`` where mounted, else cgroup v2 ``io.max``,
else none (``why`` says why). ``run(fn, ...)`` runs a read pass in a fresh process inside it;
``reads()`` counts the reads its processes completed. Needs root. ``resident(paths)`` says how
much of some files is in the page cache; ``whole_disk(path)`` names the disk holding a path.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

from packer.bench.coldread import block_disk

CGROUP_V1 = Path("/sys/fs/cgroup/blkio")


def resident(paths: Sequence[os.PathLike]) -> float:
    """Fraction of the files' pages in the page cache (mincore on a private, untouched map);
    NaN if mincore fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = cached = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as f:
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        n = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * n)()
        anchor = ctypes.c_char.from_buffer(m)
        ok = libc.mincore(ctypes.addressof(anchor), size, vec) == 0
        del anchor
        m.close()
        if not ok:
            return float("nan")
        total, cached = total + n, cached + sum(v & 1 for v in vec)
    return cached / max(total, 1)


def whole_disk(path: os.PathLike) -> Tuple[Optional[str], str]:
    """MAJ:MIN of the disk holding ``path`` (the whole disk, not a partition), and its name."""
    majmin, disk = block_disk(path)
    if disk is None:  # no block device to throttle
        return None, f"device {majmin} (not a block device)"
    majmin = (disk / "dev").read_text().strip()
    return majmin, f"/dev/{disk.name} ({majmin})"


class SlowDisk:
    """A cgroup for reading processes: limits their reads from the disk holding ``path`` to
    ``iops`` and ``bps`` (unless ``limit`` is False: then it only counts them) and counts
    them. Use as a context manager (or call ``close``): the cgroup is removed at the end.

    ``procs`` is the file a process writes its pid to, to join (``add``); None if no cgroup
    could be made, and ``why`` says why. ``how`` says what is in force, for the report.
    ``counter`` is what ``reads()`` reads: the cgroup's own counter, or without a cgroup the
    whole disk's (other processes' reads included), or None off a block device.
    """

    def __init__(self, path: os.PathLike, iops: int = 400, bps: int = 100 << 20,
                 limit: bool = True):
        self.majmin, self.disk = whole_disk(path)
        self.limit = limit
        self.path: Optional[Path] = None
        self.procs: Optional[str] = None
        self.counter: Optional[str] = None  # "v1:FILE", "v2:FILE" or "disk:FILE"
        self.how, self.why = "none", ""
        if not (hasattr(os, "geteuid") and os.geteuid() == 0):
            self.why = "not root"
        elif self.majmin is None:
            self.why = f"{path} is on {self.disk}"
        else:
            self._make(self.majmin, iops, bps, limit)
        if self.procs is None:
            self.how = f"no throttle: {self.why}"
            if self.majmin is not None:
                self.counter = f"disk:/sys/dev/block/{self.majmin}/stat"

    @property
    def throttled(self) -> bool:
        return self.procs is not None and self.limit

    def _make(self, majmin: str, iops: int, bps: int, limit: bool) -> None:
        name = f"packer-bench-{uuid.uuid4().hex[:8]}"
        if CGROUP_V1.is_dir() and (CGROUP_V1 / "blkio.throttle.read_iops_device").exists():
            cg = CGROUP_V1 / name
            try:
                cg.mkdir()
                if limit:
                    (cg / "blkio.throttle.read_iops_device").write_text(f"{majmin} {iops}\n")
                    (cg / "blkio.throttle.read_bps_device").write_text(f"{majmin} {bps}\n")
            except OSError as e:
                self._rmdir(cg)
                self.why = f"cgroup v1 blkio present but not usable ({e})"
            else:
                self._made(cg, f"v1:{cg / 'blkio.throttle.io_serviced'}", "cgroup v1",
                           f"cgroup v1 blkio.throttle: {majmin} {iops} read IOPS, {bps} read B/s")
                return
        else:
            self.why = "no cgroup v1 blkio controller mounted"
        v2 = _cgroup2_root()
        if v2 is not None and "io" in (v2 / "cgroup.controllers").read_text().split():
            cg = v2 / name
            try:
                if "io" not in (v2 / "cgroup.subtree_control").read_text().split():
                    (v2 / "cgroup.subtree_control").write_text("+io\n")
                cg.mkdir()
                if limit:
                    (cg / "io.max").write_text(f"{majmin} riops={iops} rbps={bps}\n")
            except OSError as e:
                self._rmdir(cg)
                self.why += f"; cgroup v2 io.max not usable ({e})"
            else:
                self._made(cg, f"v2:{cg / 'io.stat'}", "cgroup v2",
                           f"cgroup v2 io.max: {majmin} riops={iops} rbps={bps}")
                return
        else:
            self.why += "; no cgroup v2 with the io controller"

    def _made(self, cg: Path, counter: str, kind: str, throttle: str) -> None:
        self.path, self.procs, self.counter = cg, str(cg / "cgroup.procs"), counter
        self.how = throttle if self.limit else f"no throttle ({kind} counts the reads)"

    def add(self, pid: Optional[int] = None) -> None:
        """Move process ``pid`` (default: this one) into the cgroup; no-op without one."""
        join(self.procs, pid)

    def reads(self) -> Optional[int]:
        """Reads from the disk completed so far (see ``counter``)."""
        return read_count(self.counter, self.majmin)

    def run(self, fn: Callable, *args):
        """``fn(*args)`` in a fresh (spawned) process that joins the cgroup before calling
        it; its result. ``fn`` and the arguments must pickle (a module-level function)."""
        with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=join,
                                 initargs=(self.procs,)) as pool:
            return pool.submit(fn, *args).result()

    @staticmethod
    def _rmdir(cg: Path) -> None:
        try:
            cg.rmdir()
        except OSError:
            pass

    def close(self) -> None:
        if self.path is not None:
            self._rmdir(self.path)
            self.path = self.procs = None

    def __enter__(self) -> "SlowDisk":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def join(procs: Optional[str], pid: Optional[int] = None) -> None:
    """Move ``pid`` (default: the calling process) into the cgroup whose ``cgroup.procs`` is
    ``procs``; no-op for None."""
    if procs:
        Path(procs).write_text(str(os.getpid() if pid is None else pid))


def read_count(counter: Optional[str], majmin: Optional[str]) -> Optional[int]:
    """Reads from ``majmin`` completed so far: by the cgroup (``v1:``/``v2:`` files) or, for
    ``disk:`` (no cgroup), by the whole disk, other processes included."""
    if not counter or not majmin:
        return None
    kind, _, path = counter.partition(":")
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if kind == "v1" and len(f) == 3 and f[0] == majmin and f[1] == "Read":
            return int(f[2])
        if kind == "v2" and f and f[0] == majmin:
            return int(dict(x.split("=", 1) for x in f[1:] if "=" in x).get("rios", 0))
    if kind == "disk":
        return int(text.split()[0])
    return 0 if kind in ("v1", "v2") else None


def _cgroup2_root() -> Optional[Path]:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "cgroup2":
                return Path(fields[1])
    return None
