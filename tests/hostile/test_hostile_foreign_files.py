"""packer never replaces or deletes files it did not write.

A user's file that happens to carry a name packer uses (``shard-00000.lmdb``,
``labels.i32``) in a folder packer is pointed at is refused, not replaced; ``unstage``
deletes only what staging's marker lists; ``build --overwrite`` deletes only what the old
manifest lists, and refuses before deleting anything when the folder holds other files with
packer's names.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from packer import PackedDataset, build, merge, stage, unstage, verify
from packer.demo import make_image_folder
from packer.errors import FormatError, PackerError

USER_BYTES = b"my own results, not a packer file\n" * 1000


# -- helpers -----------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".edit")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def user_file(path: Path, data: bytes = USER_BYTES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("src") / "src", images=24, classes=3)


@pytest.fixture(scope="module")
def built(src, tmp_path_factory) -> Path:
    ds = tmp_path_factory.mktemp("built") / "ds"
    build(src, ds, progress=False, workers=0, shard_size=1 << 20)
    return ds


# -- stage / unstage ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["shard-00000.lmdb", "labels.i32"])
def test_stage_refuses_a_user_file_with_a_name_it_would_write(built, tmp_path, name):
    target = tmp_path / "target"
    mine = user_file(target / name)
    with pytest.raises(PackerError, match="did not write"):
        stage(built, target, progress=False)
    assert mine.read_bytes() == USER_BYTES
    assert not (target / "manifest.json").exists()
    assert sorted(p.name for p in target.iterdir()) == [name]


def test_unstage_deletes_only_what_the_marker_lists(built, tmp_path):
    target = tmp_path / "target"
    stage(built, target, progress=False)
    staged = sorted(p.name for p in target.iterdir())
    marker = json.loads((target / ".packer-stage.json").read_text())
    mine = {  # added after staging, some named like packer's files or temp files
        "notes.txt": user_file(target / "notes.txt"),
        "shard-00099.lmdb": user_file(target / "shard-00099.lmdb"),
        ".checkpoint.staging": user_file(target / ".checkpoint.staging"),
        ".notes.txt.staging": user_file(target / ".notes.txt.staging"),
        "manifest.json.bak": user_file(target / "manifest.json.bak"),
    }
    res = unstage(target)
    for name, p in mine.items():
        assert p.read_bytes() == USER_BYTES, f"unstage deleted or changed the user's {name}"
    assert target.is_dir() and not res.removed_dir
    assert sorted(p.name for p in target.iterdir()) == sorted(mine)
    assert set(res.removed) <= set(marker["files"]) | {".packer-stage.json"}
    assert set(staged) - {".packer-lock"} <= set(res.removed)


def test_unstage_trusts_the_marker_not_a_rewritten_manifest(built, tmp_path):
    """A staged manifest rewritten (by whoever can write TARGET) to list the user's file as a
    shard: unstage still deletes only what staging's marker lists."""
    target = tmp_path / "target"
    stage(built, target, progress=False)
    precious = user_file(target / "precious.dat")
    man = json.loads((target / "manifest.json").read_text())
    first = man["shards"][0]
    man["shards"][0] = dict(first, path="precious.dat", bytes=len(USER_BYTES),
                            sha256=sha256(precious))
    man["bytes"] = sum(s["bytes"] for s in man["shards"])
    write_json(target / "manifest.json", man)
    unstage(target)
    assert precious.read_bytes() == USER_BYTES
    assert sorted(p.name for p in target.iterdir()) == ["precious.dat"]


# -- build -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["shard-00000.lmdb", "labels.i32"])
def test_fresh_build_refuses_a_user_file_with_a_name_it_writes(src, tmp_path, name):
    dst = tmp_path / "dst"
    mine = user_file(dst / name)
    with pytest.raises(PackerError, match="does not delete files it did not write"):
        build(src, dst, progress=False, workers=0)
    assert mine.read_bytes() == USER_BYTES
    assert sorted(p.name for p in dst.iterdir()) == [name]


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_journal_temp_left_by_a_kill_does_not_block_the_rerun(src, built, tmp_path, kind):
    """kill -9 while the first journal is written leaves only ``.packer-build.json.tmp``:
    build and merge re-run; a link there is replaced, its target untouched."""
    outside = user_file(tmp_path / "outside.txt")
    for dst, run in [(tmp_path / "b", lambda d: build(src, d, progress=False, workers=0)),
                     (tmp_path / "m", lambda d: merge([built], d))]:
        dst.mkdir()
        if kind == "link":
            (dst / ".packer-build.json.tmp").symlink_to(outside)
        else:
            user_file(dst / ".packer-build.json.tmp", b'{"fingerprint": "')
        run(dst)
        assert verify(dst, progress=False).ok
        assert not (dst / ".packer-build.json.tmp").exists()
        assert outside.read_bytes() == USER_BYTES


def test_overwrite_deletes_only_what_the_old_manifest_lists(src, built, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(built, dst)
    notes = user_file(dst / "notes.txt")
    extra = user_file(dst / "shard-00099.lmdb")  # named like a shard; no manifest lists it
    before = snapshot(dst)

    with pytest.raises(PackerError, match="does not delete files it did not write"):
        build(src, dst, progress=False, workers=0, overwrite=True)
    assert snapshot(dst) == before  # refused before deleting anything: old dataset intact
    assert verify(dst, progress=False).ok
    assert len(PackedDataset(dst)) == 24

    os.rename(extra, tmp_path / "kept-elsewhere.lmdb")
    old_id = json.loads((dst / "manifest.json").read_text())["build_id"]
    build(src, dst, progress=False, workers=0, overwrite=True)  # one shard now (1 GiB shards)
    assert notes.read_bytes() == USER_BYTES
    man = json.loads((dst / "manifest.json").read_text())
    assert man["build_id"] != old_id
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["notes.txt", "manifest.json", "labels.i32", "offsets.u64", "column-width.i32",
         "column-height.i32", "paths.u64", "paths.utf8"] + [s["path"] for s in man["shards"]])
    assert verify(dst, progress=False).ok


def test_overwrite_interrupted_midway_can_be_rerun(src, built, tmp_path):
    """``build --overwrite`` stopped after it removed the old manifest and some of the old
    files (here: a folder sits at labels.i32.tmp, where it must remove a file). The same
    command, re-run once that is cleared, must finish: the old dataset's remaining files are
    packer's own, not a user's."""
    dst = tmp_path / "dst"
    shutil.copytree(built, dst)
    (dst / "labels.i32.tmp").mkdir()
    with pytest.raises(PackerError):
        build(src, dst, progress=False, workers=0, overwrite=True)
    assert not (dst / "manifest.json").exists()
    with pytest.raises(FormatError):
        PackedDataset(dst)
    (dst / "labels.i32.tmp").rmdir()
    build(src, dst, progress=False, workers=0, overwrite=True)
    assert verify(dst, progress=False).ok
    assert len(PackedDataset(dst)) == 24


# -- merge -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["labels.i32", "offsets.u64"])
def test_merge_refuses_a_user_file_with_a_name_it_writes(src, tmp_path, name):
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for k, p in enumerate(parts):
        build(src, p, part=f"{k}/2", progress=False, workers=0)
    dst = tmp_path / "merged"
    mine = user_file(dst / name)
    with pytest.raises(PackerError, match="does not delete files it did not write"):
        merge(parts, dst)
    assert mine.read_bytes() == USER_BYTES
    assert sorted(p.name for p in dst.iterdir()) == [name]
