"""Full and read-only filesystems, for real (a small tmpfs mounted here; skipped where this
process may not mount): ``unstage`` frees a full tmpfs and leaves no lock; every writing
command ends in one ``Error:`` line (a ``PackerError`` from the library), writes nothing on
a read-only mount, and on a full disk leaves what the same command, re-run once there is
room, finishes."""
from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest

from crashlib import folder_state, run
from packer import merge, stage, unstage, verify, write
from packer.demo import make_image_folder
from packer.errors import PackerError

PACKER = ["-m", "packer"]


@pytest.fixture
def mnt(tmp_path):
    """A 2 MiB tmpfs, unmounted afterwards."""
    d = tmp_path / "mnt"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not permitted'})")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny source, its two parts and the whole dataset (off the tmpfs)."""
    t = tmp_path_factory.mktemp("disks")
    make_image_folder(t / "src", images=4, classes=2, seed=1)
    for argv in (["build", t / "src", t / "built", "-q", "-j", "0"],
                 ["build", t / "src", t / "p0", "--part", "0/2", "-q", "-j", "0"],
                 ["build", t / "src", t / "p1", "--part", "1/2", "-q", "-j", "0"]):
        assert run(PACKER + [str(a) for a in argv]).returncode == 0
    return t


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill ``folder``'s filesystem up to ``leave`` bytes, with one file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
    if leave:
        with open(filler, "r+b") as f:
            f.truncate(max(0, filler.stat().st_size - leave))
    return filler


def one_error_line(proc) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("Error: ")
    return proc.stderr


def test_unstage_frees_a_full_tmpfs(data, mnt):
    assert run(PACKER + ["stage", str(data / "built"), str(mnt / "t"), "-q"]).returncode == 0
    fill(mnt)
    res = run(PACKER + ["unstage", str(mnt / "t")])
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in mnt.iterdir()) == ["filler"]  # no lock, no folder left


def test_a_full_disk_is_one_error_and_the_same_command_then_finishes(data, mnt):
    filler = fill(mnt)
    cmds = {"build": ["build", str(data / "src"), str(mnt / "b"), "-q", "-j", "0"],
            "merge": ["merge", str(data / "p0"), str(data / "p1"), str(mnt / "m")],
            "stage": ["stage", str(data / "built"), str(mnt / "s"), "-q"]}
    for argv in cmds.values():
        one_error_line(run(PACKER + argv))
        assert not list(mnt.rglob("manifest.json"))
    filler.unlink()
    for name, argv in cmds.items():
        assert run(PACKER + argv).returncode == 0, name
        assert verify(mnt / name[0], progress=False).ok


def test_merge_fills_the_disk_at_each_of_its_writes(data, tmp_path, mnt):
    """Room for one more page at a time: each failure is a PackerError, never a half dataset;
    one of them is the manifest's own write; the first run that fits equals a merge elsewhere."""
    merge([data / "p0", data / "p1"], tmp_path / "ref")
    want = folder_state(tmp_path / "ref")
    errors = []
    for pages in range(0, 64):
        shutil.rmtree(mnt / "m", ignore_errors=True)
        (mnt / "filler").unlink(missing_ok=True)
        fill(mnt, leave=pages * 4096)
        try:
            merge([data / "p0", data / "p1"], mnt / "m")
        except PackerError as e:
            errors.append(str(e))
            assert not (mnt / "m" / "manifest.json").exists()
            continue
        break
    else:
        pytest.fail("merge never fitted")
    assert any("manifest.json" in e for e in errors), errors
    got = folder_state(mnt / "m")  # the same tables; the manifest's part paths differ
    assert {k: v for k, v in got.items() if k != "manifest.json"} == \
        {k: v for k, v in want.items() if k != "manifest.json"}
    assert verify(mnt / "m", progress=False).ok


@pytest.fixture
def readonly(data, mnt):
    """The tmpfs holding a built dataset, a staged copy and an empty folder, remounted read-only."""
    shutil.copytree(data / "built", mnt / "built")
    assert run(PACKER + ["stage", str(data / "built"), str(mnt / "staged"), "-q"]).returncode == 0
    (mnt / "empty").mkdir()
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot remount read-only here ({r.stderr.strip()})")
    return mnt


@pytest.mark.parametrize("where", ["new", "empty", "built"])
def test_read_only_mount_is_one_error_for_every_writer(data, readonly, where):
    before = folder_state(readonly)
    dst = readonly / where
    cmds = [["build", str(data / "src"), str(dst), "-q", "-j", "0", "--overwrite"],
            ["merge", str(data / "p0"), str(data / "p1"), str(dst), "--overwrite"],
            ["stage", str(data / "built"), str(dst), "-q"]]
    for argv in cmds:
        one_error_line(run(PACKER + argv))
    with pytest.raises(PackerError):
        write(dst, [{"image": (data / "src" / "class_00" / "img_00000.jpg").read_bytes()}],
              progress=False, workers=1)
    with pytest.raises(PackerError):
        merge([data / "p0", data / "p1"], dst, overwrite=True)
    with pytest.raises(PackerError):
        stage(data / "built", readonly / "staged", progress=False)
    one_error_line(run(PACKER + ["unstage", str(readonly / "staged")]))
    with pytest.raises(PackerError):
        unstage(readonly / "staged")
    assert folder_state(readonly) == before
