"""`packer stage` / `unstage`: copies that are complete or rejected, repaired by re-running."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from packer import build, merge
from packer.demo import make_image_folder
from packer.errors import FormatError, PackerError
from packer.format.manifest import MANIFEST, read_manifest
from packer.reading.reader import ShardReader
from packer.format.tables import read_labels
from packer.staging import stager as stage_mod
from packer.staging import STAGE_MARKER, TMP_SUFFIX, stage, stage_once_per_node, unstage

# Side tables a dataset built today has, in the order staging copies them.
TABLE_FILES = ["labels.i32", "offsets.u64", "column-width.i32", "column-height.i32", "paths.u64", "paths.utf8"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A real small dataset with several shards, and two parts of the same source."""
    base = tmp_path_factory.mktemp("stage")
    src = make_image_folder(base / "src", images=30, classes=3)
    dst = base / "dst"
    build(src, dst, workers=0, progress=False, shard_size=1 << 20)
    parts = []
    for k in range(2):
        p = base / f"part{k}"
        build(src, p, workers=0, progress=False, shard_size=1 << 20, part=f"{k}/2")
        parts.append(p)
    assert len(read_manifest(dst)["shards"]) >= 2
    return {"src": src, "dst": dst, "parts": parts, "base": base}


@pytest.fixture
def dst(built, tmp_path):
    """A private copy of the dataset (tests may damage it)."""
    out = tmp_path / "dataset"
    shutil.copytree(built["dst"], out)
    return out


def same_records(a, b):
    ra, rb = ShardReader(a), ShardReader(b)
    try:
        assert len(ra) == len(rb) > 0
        for i in range(len(ra)):
            assert ra.read(i) == rb.read(i)
    finally:
        ra.close()
        rb.close()
    assert read_labels(a).tolist() == read_labels(b).tolist()


def shard_names(target):
    return [s["path"] for s in read_manifest(target)["shards"]]


def leftovers(target):
    return sorted(p.name for p in Path(target).iterdir() if p.name.endswith(TMP_SUFFIX))


# -- staging ---------------------------------------------------------------------------------

def test_stage_to_folder_is_complete_and_readable(dst, tmp_path):
    target = tmp_path / "ram" / "train"  # created, parents too
    res = stage(dst, target, progress=False)
    man = read_manifest(target)
    assert man["staged"]["from"] == str(dst.resolve())
    assert res.copied == shard_names(target) + TABLE_FILES
    assert res.kept == [] and res.removed == [] and res.wrote_manifest
    assert res.bytes_copied == res.bytes_total == sum(
        s["bytes"] for s in man["shards"]) + man["labels"]["bytes"] + man["offsets"]["bytes"] + sum(
        c["bytes"] for c in man["columns"].values()) + sum(t["bytes"] for t in man["paths"].values())
    assert all("/" not in p for p in shard_names(target))
    same_records(dst, target)
    msg = res.message()
    assert f"PackedDataset({str(target)!r})" in msg and "packer unstage" in msg
    assert leftovers(target) == []

    from packer.reading.dataset import PackedDataset
    ds = PackedDataset(target)
    assert len(ds) == man["count"] and ds.classes == man["classes"]


def test_rerun_is_a_noop(dst, tmp_path):
    target = tmp_path / "t"
    stage(dst, target, progress=False)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in target.iterdir()}
    res = stage(dst, target, progress=True)  # progress bar path too
    assert res.copied == [] and res.removed == [] and not res.changed
    assert sorted(res.kept) == sorted(shard_names(target) + TABLE_FILES)
    assert "nothing to do" in res.message()
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in target.iterdir()}
    assert {k: v for k, v in after.items() if not k.startswith(".packer-stage")} == \
        {k: v for k, v in before.items() if not k.startswith(".packer-stage")}


def test_interrupted_copy_is_resumed(dst, tmp_path, monkeypatch):
    target = tmp_path / "t"
    real_copy = stage_mod.copy_file
    calls = []

    def copy_then_die(f, *args, **kw):
        if len(calls) == 1:  # the second file: leave a partial temp file, then "crash"
            (Path(args[0]) / ("." + f.name + TMP_SUFFIX)).write_bytes(b"half a shard")
            raise KeyboardInterrupt
        calls.append(f.name)
        return real_copy(f, *args, **kw)

    monkeypatch.setattr(stage_mod, "copy_file", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        stage(dst, target, progress=False)
    assert not (target / MANIFEST).exists()
    with pytest.raises(FormatError):
        ShardReader(target)  # nothing accepts it as complete
    assert len(calls) == 1

    monkeypatch.setattr(stage_mod, "copy_file", real_copy)
    res = stage(dst, target, progress=False)
    assert res.kept == calls  # the finished file is kept, not recopied
    assert calls[0] not in res.copied and len(res.copied) >= 2
    assert leftovers(target) == []
    same_records(dst, target)


def test_truncated_shard_without_manifest_is_repaired(dst, tmp_path):
    target = tmp_path / "t"
    stage(dst, target, progress=False)
    first, second = shard_names(target)[:2]
    (target / MANIFEST).unlink()
    with open(target / second, "r+b") as f:
        f.truncate(1000)
    (target / ("." + first + TMP_SUFFIX)).write_bytes(b"junk")  # a stale partial copy
    res = stage(dst, target, progress=False)
    assert res.copied == [second] and res.removed == [second]
    assert first in res.kept
    assert leftovers(target) == []
    same_records(dst, target)


def test_corrupted_byte_is_repaired(dst, tmp_path):
    target = tmp_path / "t"
    stage(dst, target, progress=False)
    victim = target / shard_names(target)[0]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    # verify=False trusts sizes: the damage goes unseen (documented), verify=True finds it
    assert stage(dst, target, progress=False, verify=False).copied == []
    res = stage(dst, target, progress=False)
    assert res.copied == [victim.name] and res.removed == [victim.name]
    assert stage(dst, target, progress=False).copied == []
    same_records(dst, target)


def test_damaged_source_is_refused(dst, tmp_path):
    shard = dst / read_manifest(dst)["shards"][-1]["path"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    target = tmp_path / "ram" / "t"
    with pytest.raises(FormatError, match="source dataset is damaged.*what staging had written "
                                          "in .* was removed"):
        stage(dst, target, progress=False)
    assert not (tmp_path / "ram").exists()  # the copies, TARGET and the parent it made: gone


def test_a_failed_restage_removes_only_its_own_temp_files(dst, tmp_path):
    """Other files in a staged TARGET are left alone, even named like packer's temp files:
    a re-stage that fails removes the temp files of its own copies, nothing else."""
    target = tmp_path / "t"
    stage(dst, target, progress=False)
    (target / ".notes.staging").write_text("mine")
    (target / ".folder.staging").mkdir()
    shard = dst / read_manifest(dst)["shards"][-1]["path"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (target / shard.name).unlink()  # so the re-stage copies the damaged shard
    with pytest.raises(FormatError, match="source dataset is damaged"):
        stage(dst, target, progress=False)
    assert (target / ".notes.staging").read_text() == "mine" and (target / ".folder.staging").is_dir()
    assert not (target / f".{shard.name}.staging").exists()


def test_unfinished_source_is_refused(dst, tmp_path):
    (dst / MANIFEST).unlink()
    with pytest.raises(FormatError, match="not a packer dataset"):
        stage(dst, tmp_path / "t", progress=False)


def test_merged_dataset_stages_self_contained(built, tmp_path):
    parts = [tmp_path / p.name for p in built["parts"]]
    for p, q in zip(built["parts"], parts):
        shutil.copytree(p, q)
    merged = tmp_path / "merged"
    merge(parts, merged)
    assert any(s["path"].startswith("../") for s in read_manifest(merged)["shards"])
    target = tmp_path / "t"
    res = stage(merged, target, progress=False)
    names = shard_names(target)
    assert len(set(names)) == len(names) == len(read_manifest(merged)["shards"])
    assert all("/" not in n and (target / n).is_file() for n in names)
    assert res.copied == names + TABLE_FILES
    same_records(merged, target)
    # TARGET depends on nothing outside it
    moved = tmp_path / "elsewhere"
    target.rename(moved)
    for p in parts:
        shutil.rmtree(p)
    shutil.rmtree(merged)
    reader = ShardReader(moved)
    assert len(reader) == read_manifest(moved)["count"] == 30
    assert reader.record(0)["image"]
    reader.close()
    assert stage_mod.staging_plan(moved, read_manifest(moved))  # every file referenced is there


def test_restage_from_another_dataset_replaces_it(built, dst, tmp_path):
    target = tmp_path / "t"
    stage(dst, target, progress=False)
    part = built["parts"][0]
    res = stage(part, target, progress=False)
    assert res.removed  # the previous dataset's extra shards are gone
    assert sorted(p.name for p in target.iterdir() if not p.name.startswith(".")) == \
        sorted(shard_names(target) + TABLE_FILES + [MANIFEST])
    same_records(part, target)


def test_unsafe_targets_are_refused(built, dst, tmp_path):
    with pytest.raises(PackerError, match="dataset itself"):
        stage(dst, dst, progress=False)
    other = tmp_path / "other"
    shutil.copytree(built["parts"][0], other)
    with pytest.raises(PackerError, match="not staged"):
        stage(dst, other, progress=False)
    assert read_manifest(other) == read_manifest(built["parts"][0])  # untouched
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(PackerError, match="not a folder"):
        stage(dst, afile, progress=False)


# -- space -----------------------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs when we may mount one (root, CI); None otherwise."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        yield None
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_not_enough_space_is_refused(dst, tmp_path, small_fs, monkeypatch):
    if small_fs is None:  # no root to mount a small filesystem: pretend the disk is small
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda p: real(p)._replace(total=1 << 20, free=1 << 20))
        target = tmp_path / "t"
    else:
        target = small_fs / "train"
    with pytest.raises(PackerError) as e:
        stage(dst, target, progress=False)
    msg = str(e.value)
    assert "free" in msg and "needs" in msg and "sudo mount -t tmpfs -o size=1G" in msg
    assert not target.exists()  # nothing written, not even the folder


def test_disk_filling_up_mid_copy_is_reported(dst, small_fs, monkeypatch):
    """If the space check is fooled (another writer), ENOSPC still ends in a clear error."""
    if small_fs is None:
        pytest.skip("needs root to mount a 1 MiB tmpfs")
    monkeypatch.setattr(stage_mod, "check_space", lambda *a, **k: None)
    target = small_fs / "train"
    with pytest.raises(PackerError, match="filled up.*re-run.*was removed"):
        stage(dst, target, progress=False)
    assert not target.exists() and list(small_fs.iterdir()) == []  # the RAM is free again


def test_ram_filesystem_needs_free_ram(dst, tmp_path, monkeypatch):
    monkeypatch.setattr(stage_mod, "fs_type", lambda p: "tmpfs")
    monkeypatch.setattr(stage_mod, "meminfo",
                        lambda: {"MemTotal": 8 << 30, "MemAvailable": 300 << 20, "SwapTotal": 0})
    with pytest.raises(PackerError, match="RAM"):
        stage(dst, tmp_path / "t", progress=False)


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_stage_to_dev_shm_without_root(dst):
    target = Path("/dev/shm") / f"packer-test-{uuid.uuid4().hex[:8]} ü"
    try:
        res = stage(dst, target, progress=False)
        assert res.fstype == "tmpfs" and "in RAM" in res.message()
        same_records(dst, target)
    finally:
        if target.exists():
            unstage(target)
    assert not target.exists()


# -- unstage ---------------------------------------------------------------------------------

def test_unstage_removes_only_what_it_staged(dst, tmp_path):
    target = tmp_path / "t"
    stage(dst, target, progress=False)
    res = unstage(target)
    assert res.removed_dir and not target.exists() and res.bytes_freed > 0
    assert "freed" in res.message()

    stage(dst, target, progress=False)
    (target / "notes.txt").write_text("mine")
    res = unstage(target)
    assert not res.removed_dir
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def test_unstage_after_interrupted_stage(dst, tmp_path, monkeypatch):
    target = tmp_path / "t"

    def die(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(stage_mod, "copy_file", die)
    with pytest.raises(KeyboardInterrupt):
        stage(dst, target, progress=False)
    assert (target / STAGE_MARKER).exists()
    unstage(target)
    assert not target.exists()


def test_unstage_refuses_what_it_did_not_stage(dst, tmp_path):
    with pytest.raises(PackerError, match="not staged"):
        unstage(dst)
    (dst / STAGE_MARKER).write_text('{"files": ["manifest.json", "shard-00000.lmdb"]}')
    with pytest.raises(PackerError, match="not staged"):  # a stray marker changes nothing
        unstage(dst)
    assert read_manifest(dst) and (dst / "shard-00000.lmdb").exists()  # untouched
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x").write_text("x")
    with pytest.raises(PackerError, match="not a staged packer dataset"):
        unstage(plain)
    gone = unstage(tmp_path / "missing")  # nothing there: an unstage killed at its end is done
    assert gone.removed == [] and not gone.removed_dir and not (tmp_path / "missing").exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PackerError, match="not a folder"):
        unstage(tmp_path / "afile")


# -- several GPUs per node -------------------------------------------------------------------

def test_stage_once_per_node_without_distributed(dst, tmp_path):
    res = stage_once_per_node(dst, tmp_path / "t", progress=False)
    assert res.copied and not res.waited
    same_records(dst, tmp_path / "t")


WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from packer.staging import stage_once_per_node
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = []
    for dst, target in ((sys.argv[1], sys.argv[2]), (sys.argv[1] + "-missing", sys.argv[2] + "2")):
        try:
            res = stage_once_per_node(dst, target, progress=False)
            out.append({"copied": res.copied, "waited": res.waited, "kept": res.kept})
        except Exception as e:
            out.append({"error": type(e).__name__ + ": " + str(e)})
    dist.destroy_process_group()
    with open(sys.argv[3] + f".{rank}", "w") as f:
        json.dump(out, f)
""")


def test_stage_once_per_node_with_torch_distributed(dst, tmp_path):
    """Two ranks on one node: local rank 0 copies, rank 1 waits; then a failure reaches both."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = tmp_path / "t"
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), str(dst), str(target),
                                       str(tmp_path / "out")], env=env))
    for p in procs:
        assert p.wait(timeout=180) == 0
    (ok0, bad0), (ok1, bad1) = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert ok0["copied"] and not ok0["waited"]
    assert ok1["copied"] == [] and ok1["waited"] and ok1["kept"]
    same_records(dst, target)
    # A failure on local rank 0 reaches every rank instead of leaving them waiting.
    assert "does not exist" in bad0["error"]
    assert "failed on local rank 0" in bad1["error"]
