"""What a kill leaves at the crash points the issue found, made by hand (fast; the strace
harness in test_crash_points.py finds them for real): the same command, re-run, finishes."""
from __future__ import annotations

from helpers import quiet_build
from packer import merge, stage, unstage, verify
from packer.format.manifest import MANIFEST, OFFSETS, read_manifest, side_tables
from packer.staging import STAGE_LOCK, STAGE_MARKER
from packer.writing import journal


def test_overwrite_after_one_killed_once_it_claimed_the_old_files(photo_src, tmp_path):
    dst = tmp_path / "d"
    quiet_build(photo_src, dst, shard_size=1 << 20)
    journal.claim(dst, [s["path"] for s in read_manifest(dst)["shards"]])  # then killed
    m = quiet_build(photo_src, dst, shard_size=2 << 20, overwrite=True).manifest
    assert m["options"]["shard_size"] == 2 << 20 and verify(dst, progress=False).ok
    assert not (dst / journal.JOURNAL).exists()


def test_merge_rerun_after_a_kill_while_writing_tables_or_manifest(photo_src, tmp_path):
    parts = [tmp_path / f"p{k}" for k in range(2)]
    for k, p in enumerate(parts):
        quiet_build(photo_src, p, part=f"{k}/2")
    want = merge(parts, tmp_path / "m")
    (tmp_path / "m" / MANIFEST).unlink()  # as if killed before the manifest's rename:
    tables = [entry["path"] for _, entry, _ in side_tables(want)]
    journal.claim(tmp_path / "m", tables + [MANIFEST])  # merge's claim, and two temp files
    for name in (OFFSETS + ".tmp", MANIFEST + ".tmp"):
        (tmp_path / "m" / name).write_bytes(b"half")
    again = merge(parts, tmp_path / "m")
    assert {k: v for k, v in again.items() if k not in ("created", "build_id")} == \
        {k: v for k, v in want.items() if k not in ("created", "build_id")}
    assert sorted(p.name for p in (tmp_path / "m").iterdir() if p.name.startswith(".") or
                  p.name.endswith(".tmp")) == []
    assert merge(parts, tmp_path / "m") == again  # and once more: done, nothing changes


def test_stage_and_unstage_after_a_kill_around_the_marker(photo_src, tmp_path):
    dst = tmp_path / "d"
    quiet_build(photo_src, dst)
    target = tmp_path / "t"
    target.mkdir()
    (target / STAGE_LOCK).write_bytes(b"")
    (target / (STAGE_MARKER + ".tmp")).write_bytes(b"{")  # killed writing its first marker
    res = stage(dst, target, progress=False)
    assert res.wrote_manifest and not (target / (STAGE_MARKER + ".tmp")).exists()
    unstage(target)
    target.mkdir()
    (target / STAGE_LOCK).write_bytes(b"")  # an unstage killed after removing the marker
    assert unstage(target).removed_dir and not target.exists()
    assert unstage(target).removed == []  # and killed after removing TARGET: done
