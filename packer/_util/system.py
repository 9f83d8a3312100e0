"""Facts about the machine: usable cores, memory, filesystems, free space, full-disk errors,
human-readable sizes, which PIL is imported. Nothing here changes the process."""
from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import signal
import time
from typing import Callable, Dict, Optional, Tuple

from ..errors import PackerError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
SHORT_WRITE_ROOM = 64 << 20  # one LMDB commit's worth (writer.TXN_BYTES): less is a full disk


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cpu_quota() -> Optional[float]:
    """CPUs allowed by a container's cgroup v2 ``cpu.max`` (None when unlimited or unknown)."""
    with contextlib.suppress(OSError, ValueError), open("/sys/fs/cgroup/cpu.max") as f:
        quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    return None


def busy_cores(seconds: float = 0.5) -> Optional[float]:
    """Cores other processes keep busy now: non-idle CPU time over ``seconds`` (``/proc/stat``)
    while this process sleeps; None where it cannot be read."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    ticks = total1 - total0
    return (ticks - (idle1 - idle0)) / ticks * (os.cpu_count() or 1) if ticks > 0 else None


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux ``PR_SET_PDEATHSIG``),
    so worker processes never outlive a ``kill -9`` of the command that started them."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: workers exit when their pipe closes
        return
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(1)


def meminfo() -> Dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    out: Dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def fs_type(path: os.PathLike) -> str:
    """The type of the filesystem holding ``path`` ("tmpfs", "ext4"...), "" if unknown."""
    best: Tuple[int, str] = (-1, "")
    with contextlib.suppress(OSError):
        real = os.path.realpath(path)
        with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                # /proc/mounts writes space, tab, newline and backslash as octal (\040...)
                mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= best[0]:
                    best = (len(mnt), fields[2])
    return best[1]


def free_bytes(path: os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (0 if unknown)."""
    with contextlib.suppress(OSError):
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize
    return 0


def is_disk_full(exc: BaseException) -> bool:
    """True for a full disk, a quota or a file-size limit, however the error reached us
    (``OSError`` with an errno, or an ``lmdb.Error`` that only says it in words)."""
    if getattr(exc, "errno", None) in DISK_FULL_ERRNOS:
        return True
    text = str(exc).lower()
    return "no space left" in text or "quota exceeded" in text or "file too large" in text


@contextlib.contextmanager
def disk_full_as(path: os.PathLike, explain: Callable[[int], str], types=(OSError,)):
    """A full disk (an error of ``types`` that ``is_disk_full``) inside becomes
    ``PackerError(explain(free bytes))``; other errors pass through."""
    folder = os.path.dirname(os.fspath(path)) or "."
    try:
        yield
    except types as exc:
        # LMDB reports a write cut short by a full disk as EIO (its page flush counts only bytes)
        if not (is_disk_full(exc) or ("input/output error" in str(exc).lower()
                                      and free_bytes(folder) < SHORT_WRITE_ROOM)):
            raise
        big = getattr(exc, "errno", None) == errno.EFBIG or "file too large" in str(exc).lower()
        raise PackerError(explain(free_bytes(folder)) + (
            " (the file met a size limit, not a full disk: `ulimit -f`, or the largest file "
            "this filesystem holds)" if big else "")) from exc


def human_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: powers of 1024, one decimal (whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


SIMD_KERNEL = b"ImagingResampleHorizontalConvolution8u4x"  # Pillow-SIMD's AVX2/SSE4 resampler


def pil_info() -> Dict[str, object]:
    """Which PIL is really imported, judged from the module (Pillow-SIMD's resample kernel or
    version form) and whether libjpeg-turbo backs it; ``mismatch``: pip's record says otherwise."""
    from importlib import metadata

    import PIL
    from PIL import _imaging, features
    kernel = False
    with contextlib.suppress(OSError), open(_imaging.__file__, "rb") as f:
        kernel = SIMD_KERNEL in f.read()
    version = PIL.__version__
    flavour = "Pillow-SIMD" if kernel or ".post" in version else "Pillow"
    installed = []
    for dist in ("pillow-simd", "pillow"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed.append(f"{metadata.distribution(dist).metadata['Name']} "
                             f"{metadata.version(dist)}")
    return {
        "flavour": flavour,
        "version": version,
        "simd": flavour == "Pillow-SIMD",
        "simd_kernel": kernel,
        "module": os.path.dirname(PIL.__file__),
        "installed": installed,
        "mismatch": flavour == "Pillow" and any("simd" in d.lower() for d in installed),
        "libjpeg_turbo": bool(features.check_feature("libjpeg_turbo")),
        "jpeg_version": features.version("libjpeg_turbo") or features.version("jpg"),
    }


PILLOW_SIMD_HINT = ("pip uninstall -y pillow pillow-simd && CC='cc -mavx2' pip install "
                    "--no-cache-dir --no-binary pillow-simd pillow-simd")


def pil_summary() -> str:
    """One line for manifests, ``--version`` and reports: flavour, version, JPEG library."""
    i = pil_info()
    jpeg = f"{'libjpeg-turbo' if i['libjpeg_turbo'] else 'libjpeg'} {i['jpeg_version']}"
    hint = "" if i["simd"] else f" (Pillow-SIMD adds SIMD resizes: {PILLOW_SIMD_HINT})"
    return f"{i['flavour']} {i['version']}, {jpeg}{hint}"
