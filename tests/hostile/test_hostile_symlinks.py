"""Symlinks planted at names packer writes through never make it write elsewhere.

Someone who can write in a dataset folder (a shared DST, a node's /dev/shm) plants
``DST/NAME -> victim`` at a name packer is about to write, hoping packer (often root)
truncates or fills the victim. Each test plants real links, runs the real operation and
checks that every victim keeps its bytes and that the dataset's own files are regular files.

The build is held at a known point with a FIFO as its first image: the build (run through
``helpers.gated_packer_cmd``, as packer itself skips FIFOs) blocks opening it (its lock held,
its journal written) until the test has planted the links and writes the image into the FIFO, so the links are in place *during* the run, when packer writes the
shard temp files, the journal and the tables, not only before it starts.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

import packer
from helpers import gated_packer_cmd, packer_cmd, packer_env, release, wait_for_reader
from packer import PackedDataset, build, merge, stage, verify
from packer.demo import make_image_folder
from packer.errors import PackerError

REPO = Path(packer.__file__).resolve().parent.parent
DATASET_FILES = ("manifest.json", "labels.i32", "offsets.u64", "column-width.i32",
                 "column-height.i32", "paths.u64", "paths.utf8")
BUILD_NAMES = ("labels.i32.tmp", "offsets.u64.tmp", "manifest.json.tmp", ".packer-build.json.tmp",
               "column-width.i32.tmp", "column-height.i32.tmp", "paths.u64.tmp", "paths.utf8.tmp",
               ".shard-00000.lmdb.partial", ".shard-00000.lmdb.compact",
               ".shard-00001.lmdb.partial", ".shard-00001.lmdb.compact")


# -- helpers -----------------------------------------------------------------------------------

def make_victims(folder: Path, names) -> dict:
    """One file per name outside the dataset, with known bytes: {name: (path, bytes)}."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for n in names:
        p = folder / ("victim" + n.replace("/", "_"))
        data = f"precious data of another user, not packer's ({n})\n".encode() * 50
        p.write_bytes(data)
        out[n] = (p, data)
    return out


def plant(folder: Path, victims: dict) -> None:
    for name, (victim, _) in victims.items():
        os.symlink(victim, folder / name)


def assert_victims_unchanged(victims: dict) -> None:
    changed = [n for n, (p, data) in victims.items() if not p.is_file() or p.read_bytes() != data]
    assert not changed, f"packer wrote through the links planted at {changed}"


def assert_regular_dataset(root: Path) -> None:
    man = json.loads((root / "manifest.json").read_text())
    names = list(DATASET_FILES) + [s["path"] for s in man["shards"] if "/" not in s["path"]]
    for n in names:
        st = os.lstat(root / n)
        assert stat.S_ISREG(st.st_mode), f"{root / n} is not a regular file (a link?)"


def gated_source(root: Path, images: int = 24, last: bool = False) -> tuple:
    """An ImageFolder tree with one FIFO among its images: the first one in build order
    (class_00/aaa_gate.jpg), or the last (class_02/zzz_gate.jpg); returns (src, gate, the
    JPEG bytes to feed it)."""
    src = make_image_folder(root, images=images, classes=3)
    jpeg = (src / "class_00" / "img_00000.jpg").read_bytes()
    gate = src / ("class_02/zzz_gate.jpg" if last else "class_00/aaa_gate.jpg")
    os.mkfifo(gate)
    return src, gate, jpeg


# One transcoding build (--quality: each image is read once, by the worker step only), 1 MiB
# shards: 24 images make 2 shards, so shard temp files, the journal and the tables are all
# written after the gate.
def build_cmd(src: Path, dst: Path) -> list:
    return packer_cmd("build", src, dst, "-q", "--shard-size", "1M", "--workers", "0", "--quality", "95")


def start_gated_build(src: Path, dst: Path) -> subprocess.Popen:
    return subprocess.Popen(gated_packer_cmd(*build_cmd(src, dst)[3:]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=packer_env())


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out + err


# -- build -------------------------------------------------------------------------------------

def test_build_never_writes_through_links_planted_during_the_run(tmp_path):
    src, gate, jpeg = gated_source(tmp_path / "src")
    dst = tmp_path / "dst"
    victims = make_victims(tmp_path / "victims", BUILD_NAMES)
    proc = start_gated_build(src, dst)
    try:
        fd = wait_for_reader(gate, proc)
        # The build is blocked reading its first image: its lock and journal exist, no
        # shard, table or manifest has been written yet. Plant every name it will write.
        plant(dst, victims)
        release(fd, jpeg)
        rc, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_victims_unchanged(victims)
    assert rc == 0, out
    assert "Traceback" not in out
    assert_regular_dataset(dst)
    man = json.loads((dst / "manifest.json").read_text())
    assert len(man["shards"]) >= 2 and man["count"] == 25
    rep = verify(dst, progress=False)
    assert rep.ok, rep.problems
    assert not [p.name for p in dst.iterdir() if p.is_symlink()]


def test_build_refuses_a_planted_lock_link(tmp_path):
    src = make_image_folder(tmp_path / "src", images=24, classes=3)
    dst = tmp_path / "dst"
    dst.mkdir()
    victims = make_victims(tmp_path / "victims", [".packer-lock"])
    plant(dst, victims)
    with pytest.raises(PackerError, match="symlink"):
        build(src, dst, progress=False, workers=0)
    assert_victims_unchanged(victims)
    assert not (dst / "manifest.json").exists()
    assert os.path.islink(dst / ".packer-lock")  # not packer's: left where it was


def test_build_resumed_after_a_kill_never_writes_through_planted_links(tmp_path):
    """A build killed (SIGKILL) at its last image, after its first shard and journal were
    written; links planted at every name it writes (the stale partial shard replaced by one)
    before the same command is run again, which resumes after the finished shard."""
    src, gate, jpeg = gated_source(tmp_path / "src", last=True)
    dst = tmp_path / "dst"
    proc = start_gated_build(src, dst)
    try:
        wait_for_reader(gate, proc)
    finally:
        proc.kill()
        proc.wait()
    assert (dst / ".packer-build.json").is_file() and (dst / "shard-00000.lmdb").is_file()
    os.unlink(gate)
    gate.write_bytes(jpeg)
    for p in dst.glob(".shard-*.partial"):
        p.unlink()
    victims = make_victims(tmp_path / "victims", [n for n in BUILD_NAMES if not os.path.lexists(dst / n)])
    assert {"labels.i32.tmp", ".shard-00001.lmdb.partial", ".shard-00001.lmdb.compact"} <= set(victims)
    plant(dst, victims)
    rerun = subprocess.run(build_cmd(src, dst), capture_output=True, text=True, env=packer_env(),
                           timeout=120)
    assert_victims_unchanged(victims)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resumed after 1 finished shard" in rerun.stdout
    assert_regular_dataset(dst)
    assert verify(dst, progress=False).ok
    assert len(PackedDataset(dst)) == 25


# -- stage -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("built")
    src = make_image_folder(root / "src", images=24, classes=3)
    build(src, root / "ds", progress=False, workers=0, shard_size=1 << 20)
    return root / "ds"


def test_stage_never_writes_through_planted_temp_links(built, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    victims = make_victims(tmp_path / "victims", ["manifest.json.tmp", ".packer-stage.json.tmp"])
    plant(target, victims)
    try:  # staging (the links replaced, never written through) or refusing are both fine
        stage(built, target, progress=False)
    except PackerError:
        assert_victims_unchanged(victims)
        assert not (target / "manifest.json").exists()
        for n in victims:
            os.unlink(target / n)
        stage(built, target, progress=False)
    assert_victims_unchanged(victims)
    assert_regular_dataset(target)
    assert stat.S_ISREG(os.lstat(target / ".packer-stage.json").st_mode)
    assert verify(target, progress=False).ok
    assert len(PackedDataset(target)) == 24


def test_stage_refuses_a_planted_lock_link(built, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    victims = make_victims(tmp_path / "victims", [".packer-lock"])
    plant(target, victims)
    with pytest.raises(PackerError, match="symlink"):
        stage(built, target, progress=False)
    assert_victims_unchanged(victims)
    assert not (target / "manifest.json").exists()
    assert not (target / "shard-00000.lmdb").exists()


def test_stage_never_writes_through_a_planted_shard_temp_link(built, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    victims = make_victims(tmp_path / "victims", [".shard-00000.lmdb.staging"])
    plant(target, victims)
    # A fresh TARGET: the link is not staging's own, so staging refuses and leaves it be.
    with pytest.raises(PackerError):
        stage(built, target, progress=False)
    assert_victims_unchanged(victims)
    assert os.path.islink(target / ".shard-00000.lmdb.staging")
    assert not (target / "manifest.json").exists()

    # A TARGET staging wrote before, whose shard must be recopied: the link at the shard's
    # temp name is removed, never written through.
    os.unlink(target / ".shard-00000.lmdb.staging")
    stage(built, target, progress=False)
    with open(target / "shard-00000.lmdb", "r+b") as f:
        f.write(b"\0" * 64)  # damaged: the next stage recopies it
    plant(target, victims)
    stage(built, target, progress=False)
    assert_victims_unchanged(victims)
    assert_regular_dataset(target)
    assert verify(target, progress=False).ok


# -- merge -------------------------------------------------------------------------------------

def test_merge_never_writes_through_planted_temp_links(tmp_path):
    src = make_image_folder(tmp_path / "src", images=24, classes=3)
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for k, p in enumerate(parts):
        build(src, p, part=f"{k}/2", progress=False, workers=0)
    dst = tmp_path / "merged"
    dst.mkdir()
    victims = make_victims(tmp_path / "victims", ["labels.i32.tmp", "offsets.u64.tmp", "manifest.json.tmp"])
    plant(dst, victims)
    # Into a fresh DST: merging (the links replaced, never written through) or refusing
    # (names it did not write; then the links stay) are both fine.
    try:
        merge(parts, dst)
    except PackerError:
        assert not (dst / "manifest.json").exists()
        assert all(os.path.islink(dst / n) for n in victims)
        for n in victims:
            os.unlink(dst / n)
        merge(parts, dst)
    assert_victims_unchanged(victims)
    assert_regular_dataset(dst)
    assert verify(dst, progress=False).ok
    assert len(PackedDataset(dst)) == 24

    # Over the finished merge (overwrite), links planted beside its files: they are temp
    # names of the dataset packer is replacing, so they go, unwritten.
    for n in victims:
        assert not os.path.lexists(dst / n)
    plant(dst, victims)
    merge(parts[::-1], dst, overwrite=True)
    assert_victims_unchanged(victims)
    assert_regular_dataset(dst)
    assert verify(dst, progress=False).ok
