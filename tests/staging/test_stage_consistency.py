"""`packer stage` against a rebuilt source: ``verify=False`` never keeps a file of an older
build; and ``scripts/mount_tmpfs.sh`` sizes are what stage needs (and never wrap around).
(Concurrent stages of one TARGET: tests/hostile/test_hostile_races.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer import build
from packer.demo import make_image_folder
from packer.format.manifest import file_sha256, read_manifest, side_tables
from packer.staging import stage

ROOT = Path(__file__).resolve().parents[2]
PACKER = [sys.executable, "-m", "packer"]
SCRIPT = ROOT / "scripts" / "mount_tmpfs.sh"
MIB = 1 << 20
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("review") / "img", images=30, classes=3)


def staged_files_match(target):
    """Every file TARGET's manifest lists has the checksum listed: the copy is whole and current."""
    man = read_manifest(target)
    entries = list(man["shards"]) + [e for _, e, _ in side_tables(man)]
    return {e["path"]: file_sha256(Path(target) / e["path"]) == e["sha256"] for e in entries}


def test_no_verify_restage_of_a_rebuilt_source_copies_the_new_tables(images, tmp_path):
    dst, target = tmp_path / "ds", tmp_path / "t"
    build(images, dst, workers=0, progress=False, shard_size=1 << 20)
    stage(dst, target, progress=False)
    # Rebuilt in another order: labels, offsets, columns and paths keep their sizes.
    build(images, dst, workers=0, progress=False, shard_size=1 << 20, overwrite=True,
          shuffle=True, seed=3)
    res = stage(dst, target, progress=False, verify=False)
    assert "labels.i32" in res.copied and "offsets.u64" in res.copied
    assert all(staged_files_match(target).values()), staged_files_match(target)
    assert (target / "labels.i32").read_bytes() == (dst / "labels.i32").read_bytes()
    again = stage(dst, target, progress=False, verify=False)  # vouched for now: nothing to do
    assert not again.changed and again.copied == []


def run_script(*args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def dry_run_size(out):
    """The size= of the `mount` command a --dry-run printed."""
    line = next(line for line in out.splitlines() if line.startswith("mount "))
    return next(o[5:] for o in line.split(" -o ")[1].split()[0].split(",") if o.startswith("size="))


def test_mount_tmpfs_size_never_wraps_around(tmp_path):
    r = run_script("--dry-run", "--size", f"{2**34 + 1}G", tmp_path / "m")  # 2^64 + 1 GiB
    assert r.returncode == 2 and "not a size" in r.stderr and r.stdout == "", r


def test_mount_tmpfs_for_counts_every_table_stage_copies(tmp_path):
    dst = tmp_path / "ds"
    dst.mkdir()
    man = {"format": "packer", "format_version": "1.2", "count": 100,
           "shards": [{"path": "shard-00000.lmdb", "count": 100, "bytes": 100 * MIB, "sha256": "0" * 64}],
           "labels": {"path": "labels.i32", "bytes": 400, "sha256": "0" * 64}}
    man["offsets"] = {"path": "offsets.u64", "bytes": 40 * MIB, "sha256": "0" * 64}
    man["columns"] = {"width": {"path": "column-width.i32", "bytes": 20 * MIB,
                                "sha256": "0" * 64, "dtype": "int32"}}
    man["paths"] = {"index": {"path": "paths.u64", "bytes": 40 * MIB, "sha256": "0" * 64},
                    "text": {"path": "paths.utf8", "bytes": 60 * MIB, "sha256": "0" * 64}}
    (dst / "manifest.json").write_text(json.dumps(man))
    data = 260 * MIB + 400 + (dst / "manifest.json").stat().st_size
    r = run_script("--for", dst, "--dry-run", tmp_path / "m")
    if r.returncode == 1 and "refusing" in r.stderr:
        pytest.skip("not enough free RAM here for this size")
    assert r.returncode == 0, r.stderr
    assert dry_run_size(r.stdout) == f"{-(-(data + data // 20 + 32 * MIB) // MIB)}m"
