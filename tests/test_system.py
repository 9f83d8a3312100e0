"""packer/_system.py: cores, CPU quota, memory, filesystems, free space, disk-full, sizes, PIL."""
from __future__ import annotations

import errno
import os
import sys

import lmdb
import pytest
from PIL import Image

from packer._util.system import DISK_FULL_ERRNOS, cpu_quota, disk_full_as, free_bytes, fs_type, human_size, is_disk_full, meminfo, pil_info, pil_summary, usable_cores
from packer.errors import PackerError

linux = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_usable_cores():
    n = usable_cores()
    assert isinstance(n, int) and 1 <= n <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert n <= len(os.sched_getaffinity(0))


def test_cpu_quota():
    q = cpu_quota()
    assert q is None or (isinstance(q, float) and q > 0)
    if q is not None:
        assert usable_cores() <= max(1, -(-q // 1))  # the quota caps the cores, rounded up
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            text = f.read().split()
    except OSError:
        assert q is None
    else:
        assert (q is None) == (text[0] == "max")
        if q is not None:
            assert q == int(text[0]) / int(text[1])


@linux
def test_meminfo():
    m = meminfo()
    assert m["MemTotal"] > 64 << 20  # bytes, not kB
    assert 0 <= m["MemAvailable"] <= m["MemTotal"]
    with open("/proc/meminfo") as f:
        kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert m["MemTotal"] == kb * 1024
    assert all(isinstance(v, int) for v in m.values())


@linux
def test_fs_type(tmp_path):
    assert fs_type("/proc") == "proc"
    assert fs_type("/proc/self/status") == "proc"  # a path inside the mount, not only its root
    assert fs_type("/sys") == "sysfs"
    t = fs_type(tmp_path)
    assert t and " " not in t
    assert fs_type(tmp_path / "does" / "not" / "exist") == t  # what it would be created on
    if os.path.isdir("/dev/shm"):
        assert fs_type("/dev/shm") == "tmpfs"


@linux
def test_fs_type_follows_symlinks(tmp_path):
    (tmp_path / "to_proc").symlink_to("/proc")
    assert fs_type(tmp_path / "to_proc") == "proc"


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (10 * 1024 - 1, "10.0 KiB"), (1 << 20, "1.0 MiB"), (int(2.5 * (1 << 30)), "2.5 GiB"),
    (1 << 40, "1.0 TiB"), (3 << 50, "3072.0 TiB"), (-2048, "-2.0 KiB"), (512.4, "512 B"),
])
def test_human_size(n, text):
    assert human_size(n) == text


def test_is_disk_full_real_enospc():
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with pytest.raises(OSError) as info:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"x")
    assert is_disk_full(info.value)


def test_is_disk_full():
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert code in DISK_FULL_ERRNOS
        assert is_disk_full(OSError(code, os.strerror(code)))
    assert is_disk_full(lmdb.Error("/data/x.lmdb: No space left on device"))
    assert is_disk_full(RuntimeError("write failed: Disk quota exceeded"))
    assert is_disk_full(Exception("FILE TOO LARGE"))
    for other in (OSError(errno.ENOENT, "No such file or directory"), OSError(errno.EACCES, "denied"),
                  OSError("something else"), ValueError("space"), lmdb.MapFullError("map full"),
                  KeyboardInterrupt()):
        assert not is_disk_full(other), other


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_as(tmp_path):
    seen = []

    def explain(free):
        seen.append(free)
        return f"full, {free} bytes free"

    with pytest.raises(PackerError, match=r"^full, \d+ bytes free$") as info:
        with disk_full_as(tmp_path / "out.bin", explain):
            with open("/dev/full", "wb", buffering=0) as f:
                f.write(b"x")  # a real ENOSPC
    assert info.value.__cause__.errno == errno.ENOSPC
    assert len(seen) == 1 and 0 < seen[0] <= os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    big = r"^full, \d+ bytes free \(the file met a size limit, not a full disk: `ulimit -f`"
    with pytest.raises(PackerError, match=big):  # a file size limit is named as such
        with disk_full_as(tmp_path / "out.bin", explain):
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    with pytest.raises(FileNotFoundError):  # not a full disk: unchanged
        with disk_full_as(tmp_path / "out.bin", explain):
            open(tmp_path / "missing", "rb")
    with pytest.raises(lmdb.Error):  # a type it was not asked to catch: unchanged
        with disk_full_as(tmp_path / "out.bin", explain):
            raise lmdb.Error("No space left on device")
    with pytest.raises(PackerError):
        with disk_full_as(tmp_path / "out.bin", explain, types=(OSError, lmdb.Error)):
            raise lmdb.Error("No space left on device")
    assert len(seen) == 3


def test_free_bytes(tmp_path):
    free = free_bytes(tmp_path)
    assert isinstance(free, int) and free > 0
    st = os.statvfs(tmp_path)
    assert free <= st.f_blocks * st.f_frsize
    assert free_bytes(tmp_path / "does-not-exist") == 0


def test_pil_info():
    info = pil_info()
    assert set(info) == {"flavour", "version", "simd", "simd_kernel", "module", "installed",
                         "mismatch", "libjpeg_turbo", "jpeg_version"}
    assert info["flavour"] in ("Pillow", "Pillow-SIMD")
    assert info["version"] == Image.__version__
    assert info["simd"] is (info["flavour"] == "Pillow-SIMD")
    assert isinstance(info["libjpeg_turbo"], bool)
    assert info["jpeg_version"]


def test_pil_summary():
    info, line = pil_info(), pil_summary()
    assert "\n" not in line and line.startswith(f"{info['flavour']} {info['version']}, ")
    jpeg = "libjpeg-turbo" if info["libjpeg_turbo"] else "libjpeg"
    assert f"{jpeg} {info['jpeg_version']}" in line
    assert ("pip install pillow-simd" in line) is (not info["simd"])
