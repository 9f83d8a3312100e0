"""The CLI writes only where it was asked to, and says why when it cannot (issue 27).

A non-empty DST (build, merge, ``packer.write``) or TARGET (stage) that is neither a packer
dataset nor packer's own unfinished run is refused before anything is written, with the fix
in the one ``Error:`` line; a DST that cannot be created (/proc, below a file, a read-only
filesystem) is one line too; a refused or failed stage leaves nothing behind.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from packer import DatasetWriter, build, stage
from packer.cli import main
from packer.errors import PackerError

NOT_OURS = ("is not empty ({shown}) and holds no packer dataset; packer writes only into a new "
            "or empty folder or its own dataset, and does not delete files it did not write: ")


def invoke(*args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, f"exit {res.exit_code}, want {code}\n{res.output}\n{res.exception!r}"
    return res


def snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def dataset(photo_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("dest") / "ds"
    build(photo_src, dst, workers=0, progress=False)
    return dst


@pytest.fixture
def occupied(tmp_path):
    """A folder of someone else's files, like / or /dev/shm."""
    folder = tmp_path / "occupied"
    (folder / "sub").mkdir(parents=True)
    for name in ("notes.txt", "b.bin", "c.bin", "d.bin"):
        (folder / name).write_text("mine")
    return folder


def test_build_merge_stage_refuse_a_folder_that_is_not_theirs(photo_src, dataset, occupied):
    before = snapshot(occupied)
    shown = "b.bin, c.bin, d.bin and 2 more"
    fix = "pick a new or empty folder for the dataset, or move those files away"
    res = invoke("build", photo_src, occupied, "-q", code=1)
    assert res.stderr == f"Error: {occupied} {NOT_OURS.format(shown=shown)}{fix}\n"
    res = invoke("merge", dataset, occupied, code=1)
    assert res.stderr == f"Error: {occupied} {NOT_OURS.format(shown=shown)}{fix}\n"
    res = invoke("stage", dataset, occupied, "-q", code=1)
    assert res.stderr == (f"Error: {occupied} {NOT_OURS.format(shown=shown)}stage into a folder "
                          f"of its own, e.g. {occupied / 'ds'}\n")
    with pytest.raises(PackerError, match="is not empty"):
        DatasetWriter(occupied)
    assert snapshot(occupied) == before  # not even a lock file


def test_their_own_folders_are_still_accepted(photo_src, dataset, tmp_path):
    """Empty folders, packer's datasets (--overwrite), an unfinished build's journal and a
    staged copy (re-staged) are packer's to write."""
    empty = tmp_path / "empty"
    empty.mkdir()
    invoke("build", photo_src, empty, "-q")
    invoke("build", photo_src, empty, "-q", "--overwrite")
    invoke("stage", dataset, tmp_path / "s", "-q")
    assert invoke("stage", dataset, tmp_path / "s", "-q").stdout.count("nothing to do") == 1


def test_a_dst_that_cannot_be_created_is_one_line(photo_src, dataset, tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    for cmd in (["build", photo_src], ["merge", dataset], ["stage", dataset]):
        res = invoke(*cmd, afile / "x", code=1)
        assert res.stderr == f"Error: cannot create {afile / 'x'}: {afile} is a file, not a folder\n"
        if os.path.isdir("/proc/self"):
            res = invoke(*cmd, "/proc/x/y", code=1)
            assert res.stderr == ("Error: cannot create /proc/x/y: No such file or directory (the "
                                  "filesystem of /proc does not take new folders)\n")
    with pytest.raises(PackerError, match="is a file, not a folder"):
        stage(dataset, afile)
    assert afile.read_text() == "x"


@pytest.fixture
def read_only(tmp_path):
    """A read-only folder: a read-only tmpfs as root (which ignores permission bits), else
    one without write permission."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro, f"permission denied in {ro}"
        ro.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip()}")
    try:
        yield ro, f"{ro} is on a read-only filesystem"
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_a_read_only_dst_is_one_line(photo_src, dataset, read_only):
    ro, why = read_only
    for cmd in (["build", photo_src], ["merge", dataset], ["stage", dataset]):
        assert invoke(*cmd, ro / "new", code=1).stderr == f"Error: cannot create {ro / 'new'}: {why}\n"
        assert invoke(*cmd, ro, code=1).stderr == f"Error: cannot write in {ro}: {why}\n"


def test_stage_usage_shows_target_as_required(dataset, tmp_path):
    assert invoke("stage", "--help").stdout.startswith("Usage: main stage [OPTIONS] DST TARGET\n")
    assert "missing TARGET: packer stage DST TARGET" in invoke("stage", dataset, code=2).stderr


def test_unstage_removes_the_parent_folders_stage_made(dataset, tmp_path):
    (tmp_path / "ram").mkdir()
    invoke("stage", dataset, tmp_path / "ram" / "a" / "b" / "train", "-q")
    invoke("unstage", tmp_path / "ram" / "a" / "b" / "train")
    assert list((tmp_path / "ram").iterdir()) == []  # a/b went, ram (not made by stage) stays


def test_a_failed_stage_leaves_nothing(dataset, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(dataset, broken)
    shard = next(broken.glob("shard-*.lmdb"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    target = tmp_path / "ram" / "t"
    res = invoke("stage", broken, target, "-q", code=1)
    assert res.stderr.startswith(f"Error: {shard} does not match its manifest entry")
    assert res.stderr.endswith(f"(what staging had written in {target} was removed)\n")
    assert not (tmp_path / "ram").exists()


def test_stage_progress_counts_the_data_once(dataset, tmp_path, monkeypatch):
    from packer.staging import stager
    totals, real_bar = [], stager.tqdm

    def bar(*args, **kwargs):
        b = real_bar(*args, **kwargs)
        totals.append(b)
        return b
    monkeypatch.setattr(stager, "tqdm", bar)
    res = stage(dataset, tmp_path / "t", progress=True)
    copy_bar = next(b for b in totals if getattr(b, "desc", "").startswith("staging to"))
    assert copy_bar.total == res.bytes_total and copy_bar.n == pytest.approx(res.bytes_total)


def test_os_errors_are_one_line(dataset, tmp_path):
    res = invoke("cat", dataset, "0", "-o", tmp_path / "no" / "such" / "x.jpg", code=1)
    assert res.stderr == f"Error: {tmp_path / 'no' / 'such' / 'x.jpg'}: No such file or directory\n"


BROKEN_PIPE = """
import click
from packer.cli import library_errors

@click.command()
@library_errors
def ls():
    print("0\tfirst line", flush=True)
    raise BrokenPipeError(32, "Broken pipe")  # what writing to a closed `| head` raises

ls()
"""


def test_a_closed_pipe_is_silent():
    """`packer ls DST | head -1`: when the reader has gone, exit 1 without a word."""
    from helpers import packer_env
    done = subprocess.run([sys.executable, "-c", BROKEN_PIPE], capture_output=True, text=True,
                          env=packer_env(), timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (1, "0\tfirst line\n", "")
